// cel-oracle: Kubernetes' own DRA CEL (k8s.io/dynamic-resource-allocation/cel, as kube-apiserver
// and kube-scheduler run it) for gpudra's tests, which compare gpudra's Python evaluator with it.
//
// It reads one JSON object per line on stdin, {"expression": "...", "device": {"driver": "...",
// "attributes": {...}, "capacity": {...}, "allowMultipleAllocations": false}} (a ResourceSlice
// device's fields; "device" may be omitted), and writes one JSON object per line on stdout:
// the compile error, or the estimated cost the API server checks, and for a device the match,
// the runtime error and the actual cost under the scheduler's runtime cost limit.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"

	resourceapi "k8s.io/api/resource/v1"
	dracel "k8s.io/dynamic-resource-allocation/cel"
)

type device struct {
	Driver                   string                                                  `json:"driver"`
	Attributes               map[resourceapi.QualifiedName]resourceapi.DeviceAttribute `json:"attributes"`
	Capacity                 map[resourceapi.QualifiedName]resourceapi.DeviceCapacity  `json:"capacity"`
	AllowMultipleAllocations *bool                                                   `json:"allowMultipleAllocations"`
}

type query struct {
	Expression string  `json:"expression"`
	Device     *device `json:"device"`
}

type answer struct {
	CompileError *string `json:"compileError"`
	MaxCost      uint64  `json:"maxCost"`
	Matches      *bool   `json:"matches"`
	Error        *string `json:"error"`
	ActualCost   *uint64 `json:"actualCost"`
}

func main() {
	compiler := dracel.GetCompiler(dracel.Features{EnableConsumableCapacity: true})
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<24)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var q query
		if err := json.Unmarshal(in.Bytes(), &q); err != nil {
			fmt.Fprintln(os.Stderr, "cel-oracle: bad input:", err)
			os.Exit(2)
		}
		if err := out.Encode(evaluate(compiler, q)); err != nil {
			os.Exit(2)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, "cel-oracle:", err)
		os.Exit(2)
	}
}

func evaluate(compiler interface {
	CompileCELExpression(string, dracel.Options) dracel.CompilationResult
}, q query) answer {
	// What the API server does on create (it estimates the cost), then what the scheduler runs.
	result := compiler.CompileCELExpression(q.Expression, dracel.Options{})
	if result.Error != nil {
		message := result.Error.Error()
		return answer{CompileError: &message, MaxCost: result.MaxCost}
	}
	a := answer{MaxCost: result.MaxCost}
	if q.Device == nil {
		return a
	}
	matches, details, err := result.DeviceMatches(context.Background(), dracel.Device{
		Driver: q.Device.Driver, Attributes: q.Device.Attributes, Capacity: q.Device.Capacity,
		AllowMultipleAllocations: q.Device.AllowMultipleAllocations})
	a.Matches = &matches
	if err != nil {
		message := err.Error()
		a.Error = &message
	}
	if details != nil {
		a.ActualCost = details.ActualCost()
	}
	return a
}
