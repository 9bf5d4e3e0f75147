//go:build noextendedresources

package main

import (
	"fmt"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
)

// The operator image's build (-tags noextendedresources): the operator never explains a pod, and
// the scheduler's DynamicResources plugin, whose functions build the claim for extended resources,
// registers all of kube-scheduler's feature gates and metrics when it is linked.
const buildsExtendedClaims = false

type extendedVariant struct {
	Requests []resourceapi.DeviceRequest           `json:"requests"`
	Mappings []v1.ContainerExtendedResourceRequest `json:"mappings"`
}

type extendedPlan struct{}

func planExtended(*v1.Pod, []*resourceapi.DeviceClass, []*resourceapi.ResourceClaim, []*v1.Node,
	map[string]bool) (*extendedPlan, error) {
	return nil, fmt.Errorf("this build of gpudra-allocator (the operator image's) does not build the claim for " +
		"extended resources: run kubectl gpudra explain from the gpudra wheel (pip install gpudra)")
}

func extendedClaim(*v1.Pod, extendedVariant) *resourceapi.ResourceClaim { return nil }
