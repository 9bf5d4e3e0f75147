// gpudra-allocator: Kubernetes' own DRA allocator and DRA CEL (k8s.io/dynamic-resource-allocation
// structured and cel, the code kube-scheduler and kube-apiserver run) of one Kubernetes release,
// for `gpudra explain` and the operator's per-class device counts. Python gathers the objects and
// explains; every verdict and every selector answer comes from here. Built once per supported
// release from that release's modules (one directory each: v1.35, v1.36, ...; this file is shared,
// release.go holds what differs: the scheduler's default feature gates and how they map onto the
// library's features).
//
// Protocol: one JSON object per line on stdin, one answer per line on stdout, in order. Every
// request may carry "id" (echoed), "featureGates" (name -> bool, over this release's defaults, as
// an administrator sets --feature-gates), "timeoutSeconds" (default 60) and "filterTimeoutSeconds"
// (the scheduler's DynamicResourcesArgs.filterTimeout: 0, its default, is 10 s where the
// DRASchedulerFilterTimeout gate is on; negative: none). Ops:
//
//	features  -> {"release", "defaults", "gates", "deviceTaintRules"}: the gates in effect, and
//	          whether this build applies DeviceTaintRules (one built with -tags notaintrules, the
//	          operator image's, refuses a request they would change)
//	compile   {"expressions": [...]} -> {"results": [{"error", "maxCost"}], "costLimit"}: what the API
//	          server checks when a selector is stored (compile errors, estimated cost)
//	match     {"expressions": [...], "devices": [{"driver", "device": <ResourceSlice device>}]}
//	          -> {"compile": [...], "results": [[{"matches", "error", "actualCost"}, ...per expression]
//	          ...per device]}: each selector on each device, as the allocator runs it
//	extended  {"pod", "classes", "claims", "nodes"} -> {"extended": null | {"resources", "classes",
//	          "prior", "variants": [{"requests", "mappings"}], "nodes": [{"name", "variant",
//	          "unschedulable"}]}}: the claim kube-scheduler builds for the pod's extended resources
//	          that DeviceClasses map to DRA devices (KEP-5004), per node (null: the gate is off, or
//	          no class maps them); "claims": the pod's namespace's claims with the
//	          extended-resource-claim annotation (one from an earlier attempt)
//	allocate  {"classes", "slices", "allocatedClaims", "claims", "nodes", "deviceTaintRules",
//	          "pod", "extendedClaims", "nodeExtended"} (API objects as JSON, as the API server
//	          stores them: defaults set; the rules in the API version this release's scheduler
//	          reads) -> {"nodes": [{"name", "results": [AllocationResult per claim] | null,
//	          "error"}]}: the allocator of this release on each node, as the scheduler's Filter runs
//	          it, over the slices as its resourceslice tracker shows them (DeviceTaintRules applied
//	          where the gates are on). With "pod", "extendedClaims" (variants from extended) and
//	          "nodeExtended" (per node, the variant's index or -1), each node's variant of the
//	          extended-resource claim is allocated after "claims", as the scheduler does.
//
// A request that cannot be read is answered {"error": "..."}; the process goes on. Bounded: a line
// is at most -max-request-bytes, each request stops at its deadline (the allocator honours the
// context), and the Go heap has a soft limit (-memory-limit).
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/debug"
	"sort"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	dracel "k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

const defaultTimeout = 60 * time.Second

// kube-scheduler's DynamicResourcesArgs.filterTimeout default (pkg/scheduler/apis/config:
// DynamicResourcesFilterTimeoutDefault), applied where DRASchedulerFilterTimeout is on.
const defaultFilterTimeout = 10 * time.Second

type request struct {
	ID                   json.RawMessage `json:"id,omitempty"`
	Op                   string          `json:"op"`
	FeatureGates         map[string]bool `json:"featureGates"`
	TimeoutSeconds       float64         `json:"timeoutSeconds"`
	FilterTimeoutSeconds float64         `json:"filterTimeoutSeconds"`

	Expressions []string      `json:"expressions"`
	Devices     []matchDevice `json:"devices"`

	Classes          []*resourceapi.DeviceClass   `json:"classes"`
	Slices           []*resourceapi.ResourceSlice `json:"slices"`
	AllocatedClaims  []*resourceapi.ResourceClaim `json:"allocatedClaims"`
	Claims           []*resourceapi.ResourceClaim `json:"claims"`
	Nodes            []*v1.Node                   `json:"nodes"`
	DeviceTaintRules []json.RawMessage            `json:"deviceTaintRules"`

	Pod            *v1.Pod           `json:"pod"`
	ExtendedClaims []extendedVariant `json:"extendedClaims"`
	NodeExtended   []int             `json:"nodeExtended"`
}

type matchDevice struct {
	Driver string             `json:"driver"`
	Device resourceapi.Device `json:"device"`
}

type compiled struct {
	Error   *string `json:"error"`
	MaxCost uint64  `json:"maxCost"`
}

type outcome struct {
	Matches    bool    `json:"matches"`
	Error      *string `json:"error,omitempty"`
	ActualCost *uint64 `json:"actualCost,omitempty"`
}

type nodeAnswer struct {
	Name    string                         `json:"name"`
	Results []resourceapi.AllocationResult `json:"results"`
	Error   *string                        `json:"error"`
}

type answer struct {
	ID      json.RawMessage `json:"id,omitempty"`
	Error   *string         `json:"error,omitempty"`
	Release string          `json:"release,omitempty"`
	// Whether this build applies DeviceTaintRules (the operator image's does not: -tags notaintrules).
	DeviceTaintRules *bool `json:"deviceTaintRules,omitempty"`
	// Whether this build builds the claim for extended resources (the operator image's does not).
	ExtendedClaims *bool           `json:"extendedClaims,omitempty"`
	Defaults       map[string]bool `json:"defaults,omitempty"`
	Gates          map[string]bool `json:"gates,omitempty"`
	CostLimit      int64           `json:"costLimit,omitempty"`
	Compile        []compiled      `json:"compile,omitempty"`
	Results        any             `json:"results,omitempty"`
	Nodes          []nodeAnswer    `json:"nodes,omitempty"`
	Extended       *extendedPlan   `json:"extended,omitempty"`
}

func main() {
	maxRequest := flag.Int("max-request-bytes", 512<<20, "the longest request line accepted")
	memoryLimit := flag.Int64("memory-limit", 2<<30, "soft limit of the Go heap, bytes")
	showVersion := flag.Bool("version", false, "print the Kubernetes release and exit")
	flag.Parse()
	if *showVersion {
		fmt.Println(release)
		return
	}
	debug.SetMemoryLimit(*memoryLimit)
	in := bufio.NewReaderSize(os.Stdin, 1<<20)
	out := bufio.NewWriterSize(os.Stdout, 1<<20)
	encoder := json.NewEncoder(out)
	caches := map[string]*dracel.Cache{}
	for {
		line, err := readLine(in, *maxRequest)
		if errors.Is(err, io.EOF) {
			return
		}
		var a answer
		if err != nil {
			a = failure(err)
		} else if len(bytes.TrimSpace(line)) == 0 {
			continue
		} else {
			a = serve(line, caches)
		}
		if err := encoder.Encode(a); err != nil {
			os.Exit(2)
		}
		if err := out.Flush(); err != nil {
			os.Exit(2)
		}
	}
}

// readLine reads one line of at most limit bytes; a longer one is skipped to its end and refused.
func readLine(in *bufio.Reader, limit int) ([]byte, error) {
	var line []byte
	tooLong := false
	for {
		chunk, err := in.ReadSlice('\n')
		if !tooLong {
			if len(line)+len(chunk) > limit {
				tooLong, line = true, nil
			} else {
				line = append(line, chunk...)
			}
		}
		switch {
		case err == nil:
			if tooLong {
				return nil, fmt.Errorf("request longer than %d bytes", limit)
			}
			return line, nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		case errors.Is(err, io.EOF) && len(line) > 0 && !tooLong:
			return line, nil
		default:
			return nil, err
		}
	}
}

func failure(err error) answer {
	message := err.Error()
	return answer{Error: &message}
}

func serve(line []byte, caches map[string]*dracel.Cache) answer {
	var r request
	if err := json.Unmarshal(line, &r); err != nil {
		return failure(fmt.Errorf("bad request: %w", err))
	}
	gates, err := effectiveGates(r.FeatureGates)
	if err != nil {
		a := failure(err)
		a.ID = r.ID
		return a
	}
	timeout := defaultTimeout
	if r.TimeoutSeconds > 0 {
		timeout = time.Duration(r.TimeoutSeconds * float64(time.Second))
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	celFeatures := celFeatures(gates)
	key := fmt.Sprintf("%+v", celFeatures)
	cache := caches[key]
	if cache == nil {
		// As kube-scheduler's: a handful of compiled expressions (its own size is 10); more,
		// since the operator asks for every class's selectors in turn.
		cache = dracel.NewCache(256, celFeatures)
		caches[key] = cache
	}
	var a answer
	switch r.Op {
	case "features":
		a = answer{Release: release, Defaults: defaultGates, Gates: gates, DeviceTaintRules: ptr.To(appliesDeviceTaintRules),
			ExtendedClaims: ptr.To(buildsExtendedClaims)}
	case "compile":
		a = compileAll(r.Expressions, celFeatures)
	case "match":
		a = matchAll(ctx, r.Expressions, r.Devices, cache)
	case "extended":
		plan, err := planExtended(r.Pod, r.Classes, r.Claims, r.Nodes, gates)
		if err != nil {
			a = failure(err)
		} else {
			a = answer{Extended: plan}
		}
	case "allocate":
		a = allocate(ctx, r, gates, cache)
	default:
		a = failure(fmt.Errorf("unknown op %q (features, compile, match, extended, allocate)", r.Op))
	}
	a.ID = r.ID
	return a
}

// effectiveGates: this release's defaults with the request's settings over them; an unknown
// gate is refused, as kube-scheduler refuses one.
func effectiveGates(set map[string]bool) (map[string]bool, error) {
	gates := make(map[string]bool, len(defaultGates))
	for name, on := range defaultGates {
		gates[name] = on
	}
	var unknown []string
	for name, on := range set {
		if _, known := defaultGates[name]; !known {
			unknown = append(unknown, name)
			continue
		}
		gates[name] = on
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		return nil, fmt.Errorf("unknown DRA feature gate(s) for Kubernetes %s: %v", release, unknown)
	}
	return gates, nil
}

func errorText(err error) *string {
	if err == nil {
		return nil
	}
	return ptr.To(err.Error())
}

// compileAll: what kube-apiserver does when a selector is stored (it estimates the cost).
func compileAll(expressions []string, features dracel.Features) answer {
	compiler := dracel.GetCompiler(features)
	results := make([]compiled, len(expressions))
	for i, expression := range expressions {
		result := compiler.CompileCELExpression(expression, dracel.Options{})
		results[i] = compiled{Error: errorText(compileError(result)), MaxCost: result.MaxCost}
	}
	return answer{Compile: results, CostLimit: resourceapi.CELSelectorExpressionMaxCost}
}

func compileError(result dracel.CompilationResult) error {
	if result.Error == nil {
		return nil
	}
	return result.Error
}

// matchAll: each expression on each device, compiled and run as the allocator does (its cache,
// its runtime cost limit).
func matchAll(ctx context.Context, expressions []string, devices []matchDevice, cache *dracel.Cache) answer {
	programs := make([]dracel.CompilationResult, len(expressions))
	compiledAll := make([]compiled, len(expressions))
	for i, expression := range expressions {
		programs[i] = cache.GetOrCompile(expression)
		compiledAll[i] = compiled{Error: errorText(compileError(programs[i])), MaxCost: programs[i].MaxCost}
	}
	results := make([][]outcome, len(devices))
	for d, device := range devices {
		if err := ctx.Err(); err != nil {
			return failure(fmt.Errorf("match stopped after %d of %d devices: %w", d, len(devices), err))
		}
		row := make([]outcome, len(expressions))
		input := dracel.Device{Driver: device.Driver, AllowMultipleAllocations: device.Device.AllowMultipleAllocations,
			Attributes: device.Device.Attributes, Capacity: device.Device.Capacity}
		for i := range programs {
			if programs[i].Error != nil {
				row[i] = outcome{Error: errorText(programs[i].Error)}
				continue
			}
			matches, details, err := programs[i].DeviceMatches(ctx, input)
			row[i] = outcome{Matches: matches && err == nil, Error: errorText(runtimeError(err))}
			if details != nil {
				row[i].ActualCost = details.ActualCost()
			}
		}
		results[d] = row
	}
	return answer{Compile: compiledAll, Results: results}
}

type classLister map[string]*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) {
	classes := make([]*resourceapi.DeviceClass, 0, len(l))
	for _, class := range l {
		classes = append(classes, class)
	}
	return classes, nil
}

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	if class, ok := l[name]; ok {
		return class, nil
	}
	return nil, fmt.Errorf("deviceclass %q not found", name)
}

// allocatedState: the devices the claims' allocations hold, as kube-scheduler's claim tracker
// gathers them (admin access holds nothing; with consumable capacity, a result with a share ID
// holds a share and its consumed capacity, else the whole device).
func allocatedState(claims []*resourceapi.ResourceClaim, consumable bool) structured.AllocatedState {
	state := structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	for _, claim := range claims {
		if claim == nil || claim.Status.Allocation == nil {
			continue
		}
		for _, result := range claim.Status.Allocation.Devices.Results {
			if ptr.Deref(result.AdminAccess, false) {
				continue
			}
			id := structured.MakeDeviceID(result.Driver, result.Pool, result.Device)
			if consumable && result.ShareID != nil {
				state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, result.ShareID))
				if result.ConsumedCapacity != nil {
					state.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, result.ConsumedCapacity))
				}
				continue
			}
			state.AllocatedDevices.Insert(id)
		}
	}
	return state
}

// allocate runs the release's allocator on every node, as the scheduler's Filter does for a pod's
// claims that are not allocated yet (several nodes at once; the allocator is thread-safe).
func allocate(ctx context.Context, r request, gates map[string]bool, cache *dracel.Cache) answer {
	classes := classLister{}
	for _, class := range r.Classes {
		if class != nil {
			classes[class.Name] = class
		}
	}
	slices, err := withDeviceTaintRules(ctx, r.Slices, r.Classes, r.DeviceTaintRules, gates)
	if err != nil {
		return failure(err)
	}
	state := allocatedState(r.AllocatedClaims, gates["DRAConsumableCapacity"])
	allocator, err := structured.NewAllocator(ctx, allocatorFeatures(gates), state, classes, slices, cache)
	if err != nil {
		return failure(err)
	}
	claimsOn, err := nodeClaims(r)
	if err != nil {
		return failure(err)
	}
	filterTimeout := time.Duration(0)
	switch {
	case r.FilterTimeoutSeconds > 0:
		filterTimeout = time.Duration(r.FilterTimeoutSeconds * float64(time.Second))
	case r.FilterTimeoutSeconds == 0 && gates["DRASchedulerFilterTimeout"]:
		filterTimeout = defaultFilterTimeout
	}
	answers := make([]nodeAnswer, len(r.Nodes))
	work := make(chan int)
	var wg sync.WaitGroup
	for w := 0; w < runtime.GOMAXPROCS(0); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				node := r.Nodes[i]
				results, err := allocateOn(ctx, allocator, node, claimsOn(i), filterTimeout)
				answers[i] = nodeAnswer{Name: node.Name, Results: results, Error: errorText(err)}
			}
		}()
	}
	for i := range r.Nodes {
		work <- i
	}
	close(work)
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return failure(fmt.Errorf("allocation stopped at its deadline: %w", err))
	}
	return answer{Nodes: answers}
}

// nodeClaims: the claims to allocate on the i-th node: the request's, then that node's variant of
// the extended-resource claim (the scheduler's Filter puts it where the pod's in-memory claim is,
// after the pod's own claims).
func nodeClaims(r request) (func(int) []*resourceapi.ResourceClaim, error) {
	if len(r.NodeExtended) == 0 {
		return func(int) []*resourceapi.ResourceClaim { return r.Claims }, nil
	}
	if r.Pod == nil || len(r.NodeExtended) != len(r.Nodes) {
		return nil, fmt.Errorf("nodeExtended needs the pod and one entry per node (%d nodes, %d entries)",
			len(r.Nodes), len(r.NodeExtended))
	}
	built := make([]*resourceapi.ResourceClaim, len(r.ExtendedClaims))
	for i, variant := range r.ExtendedClaims {
		built[i] = extendedClaim(r.Pod, variant)
	}
	for _, index := range r.NodeExtended {
		if index < -1 || index >= len(built) {
			return nil, fmt.Errorf("nodeExtended: no extended claim %d (%d given)", index, len(built))
		}
	}
	return func(i int) []*resourceapi.ResourceClaim {
		if r.NodeExtended[i] < 0 {
			return r.Claims
		}
		return append(append(make([]*resourceapi.ResourceClaim, 0, len(r.Claims)+1), r.Claims...), built[r.NodeExtended[i]])
	}, nil
}

// allocateOn: the allocator on one node within the scheduler's filter timeout, as its Filter runs
// it: a node that takes longer is the scheduler's error for the pod (it retries with backoff).
func allocateOn(ctx context.Context, allocator structured.Allocator, node *v1.Node,
	claims []*resourceapi.ResourceClaim, timeout time.Duration) ([]resourceapi.AllocationResult, error) {
	if timeout <= 0 {
		return allocator.Allocate(ctx, node, claims)
	}
	nodeCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	results, err := allocator.Allocate(nodeCtx, node, claims)
	if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
		return nil, fmt.Errorf("node %s: timed out trying to allocate devices (the scheduler's filter timeout, %s)",
			node.Name, timeout)
	}
	return results, err
}
