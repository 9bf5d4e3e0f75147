//go:build !noextendedresources

package main

import (
	"encoding/json"
	"fmt"
	"sort"
	_ "unsafe" // go:linkname

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	resourcehelper "k8s.io/component-helpers/resource"
	"k8s.io/dynamic-resource-allocation/deviceclass/extendedresourcecache"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	schedframework "k8s.io/kubernetes/pkg/scheduler/framework"
	_ "k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources" // the functions linked below
	schedutil "k8s.io/kubernetes/pkg/scheduler/util"
)

// The claim kube-scheduler builds for a pod's extended resources that DeviceClasses map to DRA
// devices (KEP-5004, the DRAExtendedResource gate). The scheduler's DynamicResources plugin keeps
// this in unexported functions (pkg/scheduler/framework/plugins/dynamicresources,
// extendeddynamicresources.go); rather than copy them, the helper links the release's own through
// go:linkname. Their signatures are the same in 1.35, 1.36 and 1.37; a release that changes one
// fails the helper's tests (its requests are compared with the claims the real scheduler creates).

//go:linkname hasDeviceClassMappedExtendedResource k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources.hasDeviceClassMappedExtendedResource
func hasDeviceClassMappedExtendedResource(reqs v1.ResourceList, cache fwk.DeviceClassResolver) bool

//go:linkname findExtendedResourceClaim k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources.findExtendedResourceClaim
func findExtendedResourceClaim(pod *v1.Pod, resourceClaims []*resourceapi.ResourceClaim) *resourceapi.ResourceClaim

//go:linkname createRequestsAndMappings k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources.createRequestsAndMappings
func createRequestsAndMappings(pod *v1.Pod, extendedResources map[v1.ResourceName]int64, logger klog.Logger,
	deviceClassMapping fwk.DeviceClassResolver) ([]resourceapi.DeviceRequest, []v1.ContainerExtendedResourceRequest)

const buildsExtendedClaims = true

// extendedVariant: the claim's requests on a set of nodes (they differ only where a node's device
// plugin serves some of the resources), and which container's resource each request serves.
type extendedVariant struct {
	Requests []resourceapi.DeviceRequest           `json:"requests"`
	Mappings []v1.ContainerExtendedResourceRequest `json:"mappings"`
}

// extendedNode: what the scheduler's Filter makes of the pod's extended resources on one node:
// the variant of the claim to allocate there, none when device plugins serve them all
// (NodeResourcesFit decides), or why the pod cannot go there at all.
type extendedNode struct {
	Name          string  `json:"name"`
	Variant       *int    `json:"variant"`
	Unschedulable *string `json:"unschedulable,omitempty"`
}

type extendedPlan struct {
	// The pod's requests of extended resources that some DeviceClass maps, and that class.
	Resources map[string]int64  `json:"resources"`
	Classes   map[string]string `json:"classes"`
	// The claim an earlier scheduling cycle created for the pod (annotated and owned by it).
	Prior    *string           `json:"prior"`
	Variants []extendedVariant `json:"variants"`
	Nodes    []extendedNode    `json:"nodes"`
}

// planExtended: nil when the gate is off or no DeviceClass maps the pod's extended resources (the
// scheduler's PreFilter then leaves them to device plugins); else, per node, what Filter does with
// them (filterExtendedResources, same release).
func planExtended(pod *v1.Pod, classes []*resourceapi.DeviceClass, claims []*resourceapi.ResourceClaim,
	nodes []*v1.Node, gates map[string]bool) (*extendedPlan, error) {
	if pod == nil {
		return nil, fmt.Errorf("extended needs the pod")
	}
	if !gates["DRAExtendedResource"] {
		return nil, nil
	}
	logger := klog.Background()
	resolver := extendedresourcecache.NewExtendedResourceCache(logger)
	for _, class := range classes {
		if class != nil {
			resolver.OnAdd(class, true)
		}
	}
	reqs := resourcehelper.PodRequests(pod, resourcehelper.PodResourcesOptions{})
	if !hasDeviceClassMappedExtendedResource(reqs, resolver) {
		return nil, nil
	}
	plan := &extendedPlan{Resources: map[string]int64{}, Classes: map[string]string{}, Variants: []extendedVariant{}}
	podScalar := schedframework.NewResource(reqs).ScalarResources
	for name, quantity := range podScalar {
		if class := resolver.GetDeviceClass(name); class != nil && schedutil.IsDRAExtendedResourceName(name) && quantity != 0 {
			plan.Resources[string(name)] = quantity
			plan.Classes[string(name)] = class.Name
		}
	}
	prior := findExtendedResourceClaim(pod, claims)
	if prior != nil {
		plan.Prior = &prior.Name
	}
	variants := map[string]int{}
	for _, node := range nodes {
		answer := extendedNode{Name: node.Name}
		if prior != nil {
			if prior.Spec.Devices.Requests != nil {
				// The scheduler deletes it in PostFilter and tries again.
				answer.Unschedulable = ptrTo("cannot schedule extended resource claim " + prior.Name +
					" (from an earlier scheduling attempt)")
			}
			plan.Nodes = append(plan.Nodes, answer)
			continue
		}
		extended, unfit := draServed(podScalar, node, resolver)
		switch {
		case unfit != "":
			answer.Unschedulable = ptrTo(unfit)
		case len(extended) > 0:
			requests, mappings := createRequestsAndMappings(pod, extended, logger, resolver)
			variant := extendedVariant{Requests: requests, Mappings: mappings}
			key, err := json.Marshal(variant)
			if err != nil {
				return nil, err
			}
			index, seen := variants[string(key)]
			if !seen {
				index = len(plan.Variants)
				variants[string(key)] = index
				plan.Variants = append(plan.Variants, variant)
			}
			answer.Variant = &index
		}
		plan.Nodes = append(plan.Nodes, answer)
	}
	return plan, nil
}

// draServed: the resources the node must provide through DRA (a class maps them and the node's
// allocatable has none), or the one neither a device plugin nor a class provides. The loop of
// filterExtendedResources, which takes the scheduler's per-cycle state and cannot be linked.
func draServed(podScalar map[v1.ResourceName]int64, node *v1.Node, resolver fwk.DeviceClassResolver) (map[v1.ResourceName]int64, string) {
	allocatable := schedframework.NewResource(node.Status.Allocatable).ScalarResources
	names := make([]string, 0, len(podScalar))
	for name := range podScalar {
		names = append(names, string(name))
	}
	sort.Strings(names) // the scheduler walks a map; the first unfit name is reported in order here
	extended := map[v1.ResourceName]int64{}
	for _, n := range names {
		name := v1.ResourceName(n)
		quantity := podScalar[name]
		if !schedutil.IsDRAExtendedResourceName(name) || quantity == 0 {
			continue
		}
		available, listed := allocatable[name]
		if resolver.GetDeviceClass(name) != nil && available == 0 {
			extended[name] = quantity
		} else if !listed {
			return nil, fmt.Sprintf("cannot fit resource %s: no device plugin on the node offers it and no DeviceClass maps it", name)
		}
	}
	return extended, ""
}

// extendedClaim: the claim the scheduler keeps in memory for the pod on a node, before PreBind
// creates it (same name, owner and annotation).
func extendedClaim(pod *v1.Pod, variant extendedVariant) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: pod.Namespace, Name: "<extended-resources>", GenerateName: pod.Name + "-extended-resources-",
			UID:         "extended-resources-" + pod.UID,
			Annotations: map[string]string{resourceapi.ExtendedResourceClaimAnnotation: "true"},
		},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: variant.Requests}},
	}
}

func ptrTo(s string) *string { return &s }
