// metadata-check (Kubernetes 1.36): reads device metadata files (KEP-5304) with the decoder
// containers use, k8s.io/dynamic-resource-allocation/devicemetadata of the release, into the only
// version it knows (v1alpha1; the release has no validation of it). One JSON line per file:
// {"path", "apiVersion", "validation" (always ""), "metadata"}; exit 1 on a file it cannot decode.
// The tests (tests/metadatacheck.py) run it on the agent's files; `make metadata-check`
// (hack/metadata-check-bin.sh) builds it. Never commit the binary.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/dynamic-resource-allocation/api/metadata/v1alpha1"
	"k8s.io/dynamic-resource-allocation/devicemetadata"
)

func main() {
	failed := false
	for _, path := range os.Args[1:] {
		if err := check(path); err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", path, err)
			failed = true
		}
	}
	if failed {
		os.Exit(1)
	}
}

func check(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	var dm v1alpha1.DeviceMetadata
	if err := devicemetadata.DecodeMetadataFromStream(json.NewDecoder(f), &dm); err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{
		"path": path, "apiVersion": v1alpha1.SchemeGroupVersion.String(), "validation": "", "metadata": dm})
}
