// What Kubernetes 1.37 differs in: the DRA feature gates its kube-scheduler starts with, and how
// the scheduler hands them to the allocator and the CEL environment
// (pkg/scheduler/framework/plugins/dynamicresources: AllocatorFeatures and the cel.NewCache call;
// defaults from pkg/features/kube_features.go of that release).
package main

import (
	"context"
	"encoding/json"
	"fmt"

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

// withDeviceTaintRules: the slices as the scheduler sees them once DeviceTaintRules are applied
// (resourceslice/tracker). Not yet: a cluster with such rules is refused rather than answered
// inexactly.
func withDeviceTaintRules(_ context.Context, slices []*resourceapi.ResourceSlice, rules []json.RawMessage,
	gates map[string]bool) ([]*resourceapi.ResourceSlice, error) {
	if len(rules) > 0 && gates["DRADeviceTaintRules"] {
		return nil, fmt.Errorf("%d DeviceTaintRule(s) in the cluster: gpudra-allocator does not apply them yet", len(rules))
	}
	return slices, nil
}
