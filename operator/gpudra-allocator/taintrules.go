//go:build !notaintrules

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/resourceslice/tracker"
)

// staticInformer serves a fixed list to an informer: no API server and no client, the objects a
// request carries. Its watch stays open and silent until the informer stops.
func staticInformer(list runtime.Object, example runtime.Object) cache.SharedIndexInformer {
	return cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
		ListWithContextFunc: func(context.Context, metav1.ListOptions) (runtime.Object, error) {
			return list.DeepCopyObject(), nil
		},
		WatchFuncWithContext: func(context.Context, metav1.ListOptions) (watch.Interface, error) {
			return watch.NewFake(), nil
		},
	}, listOnly{}), example, 0, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
}

// listOnly tells the informer's reflector to list, not to stream the list through a watch.
type listOnly struct{}

func (listOnly) IsWatchListSemanticsUnSupported() bool { return true }

// informerOf serves items, as the List list, to an informer of example's kind.
func informerOf[T runtime.Object](list runtime.Object, example runtime.Object, items []T) (cache.SharedIndexInformer, error) {
	objects := make([]runtime.Object, 0, len(items))
	for _, item := range items {
		objects = append(objects, item)
	}
	if err := meta.SetList(list, objects); err != nil {
		return nil, err
	}
	return staticInformer(list, example), nil
}

// decodeRules reads the request's DeviceTaintRules as the release's API type.
func decodeRules[T any, PT interface {
	*T
	runtime.Object
}](raw []json.RawMessage) ([]PT, error) {
	rules := make([]PT, 0, len(raw))
	for i, text := range raw {
		rule := PT(new(T))
		if err := json.Unmarshal(text, rule); err != nil {
			return nil, fmt.Errorf("deviceTaintRules[%d]: %w", i, err)
		}
		rules = append(rules, rule)
	}
	return rules, nil
}

// patchedSlices runs the release's resourceslice tracker (kube-scheduler's, which adds the taints
// of DeviceTaintRules to the devices they select) over the informers, and returns the slices it
// lists once synced.
func patchedSlices(ctx context.Context, options tracker.Options, informers ...cache.SharedIndexInformer) ([]*resourceapi.ResourceSlice, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	t, err := tracker.StartTracker(ctx, options)
	if err != nil {
		return nil, fmt.Errorf("DeviceTaintRules: %w", err)
	}
	defer t.Stop()
	for _, informer := range informers {
		go informer.RunWithContext(ctx)
	}
	if err := wait.PollUntilContextCancel(ctx, time.Millisecond, true, func(context.Context) (bool, error) {
		return t.HasSynced(), nil
	}); err != nil {
		return nil, fmt.Errorf("DeviceTaintRules: the tracker did not sync: %w", err)
	}
	return t.ListPatchedResourceSlices()
}
