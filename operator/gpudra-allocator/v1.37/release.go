// What Kubernetes 1.37 differs in: the DRA feature gates its kube-scheduler starts with, and how
// the scheduler hands them to the allocator and the CEL environment
// (pkg/scheduler/framework/plugins/dynamicresources: AllocatorFeatures and the cel.NewCache call;
// defaults from pkg/features/kube_features.go of that release).
package main

import (
	"context"
	"encoding/json"
	"fmt"

	"k8s.io/apimachinery/pkg/runtime"
	resourceinformers "k8s.io/client-go/informers/resource/v1"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/resourceslice/tracker"

	resourceapi "k8s.io/api/resource/v1"
	dracel "k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
)

const release = "1.37.2"

var defaultGates = map[string]bool{
	"DRAAdminAccess":               true,
	"DRAConsumableCapacity":        true,
	"DRADerivedAttributes":         false,
	"DRADeviceBindingConditions":   true,
	"DRADeviceCompatibilityGroups": false,
	"DRADeviceTaintRules":          true,
	"DRADeviceTaints":              true,
	"DRAExtendedResource":          true,
	"DRAFractionalCapacityRange":   false,
	"DRAListTypeAttributes":        false,
	"DRAOptionalNodeOperations":    false,
	"DRAPartitionableDevices":      true,
	"DRAPrioritizedList":           true,
	"DRAResourceClaimDeviceStatus": true,
}

func allocatorFeatures(g map[string]bool) structured.Features {
	return structured.Features{
		AdminAccess:             g["DRAAdminAccess"],
		PrioritizedList:         g["DRAPrioritizedList"],
		PartitionableDevices:    g["DRAPartitionableDevices"],
		DeviceTaints:            g["DRADeviceTaints"],
		DeviceBindingAndStatus:  g["DRADeviceBindingConditions"] && g["DRAResourceClaimDeviceStatus"],
		ConsumableCapacity:      g["DRAConsumableCapacity"],
		FractionalCapacityRange: g["DRAFractionalCapacityRange"],
		ListTypeAttributes:      g["DRAListTypeAttributes"],
		OptionalNodeOperations:  g["DRAOptionalNodeOperations"],
		DerivedAttributes:       g["DRADerivedAttributes"],
		CompatibilityGroups:     g["DRADeviceCompatibilityGroups"],
	}
}

func celFeatures(g map[string]bool) dracel.Features {
	return dracel.Features{EnableConsumableCapacity: g["DRAConsumableCapacity"], EnableListTypeAttributes: g["DRAListTypeAttributes"]}
}

func runtimeError(err error) error {
	return dracel.EnhanceRuntimeError(err)
}

// withDeviceTaintRules: the slices as kube-scheduler sees them, with the DeviceTaintRules' taints
// added by Kubernetes' own resourceslice tracker (ListPatchedResourceSlices).
func withDeviceTaintRules(ctx context.Context, slices []*resourceapi.ResourceSlice, _ []*resourceapi.DeviceClass,
	raw []json.RawMessage, gates map[string]bool) ([]*resourceapi.ResourceSlice, error) {
	if len(raw) == 0 || !gates["DRADeviceTaints"] || !gates["DRADeviceTaintRules"] {
		return slices, nil
	}
	sliceObjects := make([]runtime.Object, 0, len(slices))
	for _, slice := range slices {
		sliceObjects = append(sliceObjects, slice)
	}
	ruleObjects := make([]runtime.Object, 0, len(raw))
	for i, text := range raw {
		rule := &resourceapi.DeviceTaintRule{}
		if err := json.Unmarshal(text, rule); err != nil {
			return nil, fmt.Errorf("deviceTaintRules[%d]: %w", i, err)
		}
		ruleObjects = append(ruleObjects, rule)
	}
	sliceList, err := listOf(&resourceapi.ResourceSliceList{}, sliceObjects)
	if err != nil {
		return nil, err
	}
	ruleList, err := listOf(&resourceapi.DeviceTaintRuleList{}, ruleObjects)
	if err != nil {
		return nil, err
	}
	sliceInformer := staticInformer(sliceList, &resourceapi.ResourceSlice{})
	ruleInformer := staticInformer(ruleList, &resourceapi.DeviceTaintRule{})
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
