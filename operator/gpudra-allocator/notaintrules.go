//go:build notaintrules

package main

import (
	"context"
	"encoding/json"
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
)

// The operator image's build (-tags notaintrules): the operator only matches devices against
// selectors, and Kubernetes' resourceslice tracker, which applies DeviceTaintRules, links all of
// client-go's API types (8 MiB more resident memory). A request with rules the release applies is
// refused, never answered without them.
const appliesDeviceTaintRules = false

func withDeviceTaintRules(_ context.Context, slices []*resourceapi.ResourceSlice, _ []*resourceapi.DeviceClass,
	rules []json.RawMessage, gates map[string]bool) ([]*resourceapi.ResourceSlice, error) {
	if len(rules) > 0 && gates["DRADeviceTaints"] && gates["DRADeviceTaintRules"] {
		return nil, fmt.Errorf("%d DeviceTaintRule(s) apply, and this build of gpudra-allocator (the operator image's) "+
			"does not apply them: run kubectl gpudra explain from the gpudra wheel (pip install gpudra)", len(rules))
	}
	return slices, nil
}
