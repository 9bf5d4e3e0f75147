//go:build !notaintrules

package main

import (
	"context"
	"encoding/json"

	resourceapi "k8s.io/api/resource/v1"
	resourcealphaapi "k8s.io/api/resource/v1alpha3"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	resourcealphalisters "k8s.io/client-go/listers/resource/v1alpha3"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/resourceslice/tracker"
)

const appliesDeviceTaintRules = true

// withDeviceTaintRules: the slices as kube-scheduler sees them, with the DeviceTaintRules' taints
// (resource.k8s.io/v1alpha3 in this release) added by Kubernetes' own resourceslice tracker
// (ListPatchedResourceSlices); it reads the DeviceClasses, which a rule's selector may name.
func withDeviceTaintRules(ctx context.Context, slices []*resourceapi.ResourceSlice, classes []*resourceapi.DeviceClass,
	raw []json.RawMessage, gates map[string]bool) ([]*resourceapi.ResourceSlice, error) {
	if len(raw) == 0 || !gates["DRADeviceTaints"] || !gates["DRADeviceTaintRules"] {
		return slices, nil
	}
	rules, err := decodeRules[resourcealphaapi.DeviceTaintRule](raw)
	if err != nil {
		return nil, err
	}
	sliceInformer, err := informerOf(&resourceapi.ResourceSliceList{}, &resourceapi.ResourceSlice{}, slices)
	if err != nil {
		return nil, err
	}
	classInformer, err := informerOf(&resourceapi.DeviceClassList{}, &resourceapi.DeviceClass{}, classes)
	if err != nil {
		return nil, err
	}
	ruleInformer, err := informerOf(&resourcealphaapi.DeviceTaintRuleList{}, &resourcealphaapi.DeviceTaintRule{}, rules)
	if err != nil {
		return nil, err
	}
	return patchedSlices(ctx, tracker.Options{
		EnableDeviceTaintRules:   true,
		EnableConsumableCapacity: gates["DRAConsumableCapacity"],
		SliceInformer:            sliceInformerOf{sliceInformer},
		TaintInformer:            ruleInformerOf{ruleInformer},
		ClassInformer:            classInformerOf{classInformer},
	}, sliceInformer, classInformer, ruleInformer)
}

type sliceInformerOf struct{ cache.SharedIndexInformer }

func (s sliceInformerOf) Informer() cache.SharedIndexInformer { return s.SharedIndexInformer }
func (s sliceInformerOf) Lister() resourcelisters.ResourceSliceLister {
	return resourcelisters.NewResourceSliceLister(s.GetIndexer())
}

type classInformerOf struct{ cache.SharedIndexInformer }

func (c classInformerOf) Informer() cache.SharedIndexInformer { return c.SharedIndexInformer }
func (c classInformerOf) Lister() resourcelisters.DeviceClassLister {
	return resourcelisters.NewDeviceClassLister(c.GetIndexer())
}

type ruleInformerOf struct{ cache.SharedIndexInformer }

func (r ruleInformerOf) Informer() cache.SharedIndexInformer { return r.SharedIndexInformer }
func (r ruleInformerOf) Lister() resourcealphalisters.DeviceTaintRuleLister {
	return resourcealphalisters.NewDeviceTaintRuleLister(r.GetIndexer())
}
