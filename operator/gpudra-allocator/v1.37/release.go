// What Kubernetes 1.37 differs in: the DRA feature gates its kube-scheduler starts with, and how
// the scheduler hands them to the allocator and the CEL environment
// (pkg/scheduler/framework/plugins/dynamicresources: AllocatorFeatures and the cel.NewCache call;
// defaults from pkg/features/kube_features.go of that release).
package main

import (
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
	"DRASchedulerFilterTimeout":    true,
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
