//go:build !notaintrules

package main

import (
	"context"
	"encoding/json"

	resourceapi "k8s.io/api/resource/v1"
	resourceinformers "k8s.io/client-go/informers/resource/v1"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/resourceslice/tracker"
)

const appliesDeviceTaintRules = true

// withDeviceTaintRules: the slices as kube-scheduler sees them, with the DeviceTaintRules' taints
// added by Kubernetes' own resourceslice tracker (ListPatchedResourceSlices).
func withDeviceTaintRules(ctx context.Context, slices []*resourceapi.ResourceSlice, _ []*resourceapi.DeviceClass,
	raw []json.RawMessage, gates map[string]bool) ([]*resourceapi.ResourceSlice, error) {
	if len(raw) == 0 || !gates["DRADeviceTaints"] || !gates["DRADeviceTaintRules"] {
		return slices, nil
	}
	rules, err := decodeRules[resourceapi.DeviceTaintRule](raw)
	if err != nil {
		return nil, err
	}
	sliceInformer, err := informerOf(&resourceapi.ResourceSliceList{}, &resourceapi.ResourceSlice{}, slices)
	if err != nil {
		return nil, err
	}
	ruleInformer, err := informerOf(&resourceapi.DeviceTaintRuleList{}, &resourceapi.DeviceTaintRule{}, rules)
	if err != nil {
		return nil, err
	}
	return patchedSlices(ctx, tracker.Options{
		EnableDeviceTaintRules:   true,
		EnableConsumableCapacity: gates["DRAConsumableCapacity"],
		SliceInformer:            typedSlices{resourceinformers.ToResourceSliceIndexInformer(sliceInformer)},
		TaintInformer:            typedRules{resourceinformers.ToDeviceTaintRuleIndexInformer(ruleInformer)},
	}, sliceInformer, ruleInformer)
}

type typedSlices struct {
	informer resourceinformers.ResourceSliceIndexInformer
}

func (s typedSlices) Informer() cache.SharedIndexInformer                         { return s.informer }
func (s typedSlices) TypedInformer() resourceinformers.ResourceSliceIndexInformer { return s.informer }
func (s typedSlices) Lister() resourcelisters.ResourceSliceLister {
	return resourcelisters.NewResourceSliceLister(s.informer.GetIndexer())
}

type typedRules struct {
	informer resourceinformers.DeviceTaintRuleIndexInformer
}

func (r typedRules) Informer() cache.SharedIndexInformer                           { return r.informer }
func (r typedRules) TypedInformer() resourceinformers.DeviceTaintRuleIndexInformer { return r.informer }
func (r typedRules) Lister() resourcelisters.DeviceTaintRuleLister {
	return resourcelisters.NewDeviceTaintRuleLister(r.informer.GetIndexer())
}
