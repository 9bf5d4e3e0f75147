//go:build !notaintrules

package main

import (
	"context"
	"encoding/json"
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	resourcealphaapi "k8s.io/api/resource/v1alpha3"
	"k8s.io/apimachinery/pkg/runtime"
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
	sliceObjects := make([]runtime.Object, 0, len(slices))
	for _, slice := range slices {
		sliceObjects = append(sliceObjects, slice)
	}
	classObjects := make([]runtime.Object, 0, len(classes))
	for _, class := range classes {
		classObjects = append(classObjects, class)
	}
	ruleObjects := make([]runtime.Object, 0, len(raw))
	for i, text := range raw {
		rule := &resourcealphaapi.DeviceTaintRule{}
		if err := json.Unmarshal(text, rule); err != nil {
			return nil, fmt.Errorf("deviceTaintRules[%d]: %w", i, err)
		}
		ruleObjects = append(ruleObjects, rule)
	}
	sliceList, err := listOf(&resourceapi.ResourceSliceList{}, sliceObjects)
	if err != nil {
		return nil, err
	}
	classList, err := listOf(&resourceapi.DeviceClassList{}, classObjects)
	if err != nil {
		return nil, err
	}
	ruleList, err := listOf(&resourcealphaapi.DeviceTaintRuleList{}, ruleObjects)
	if err != nil {
		return nil, err
	}
	sliceInformer := staticInformer(sliceList, &resourceapi.ResourceSlice{})
	classInformer := staticInformer(classList, &resourceapi.DeviceClass{})
	ruleInformer := staticInformer(ruleList, &resourcealphaapi.DeviceTaintRule{})
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
