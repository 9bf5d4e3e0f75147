// metadata-check (Kubernetes 1.37): reads device metadata files (KEP-5304) with the decoder
// containers use, k8s.io/dynamic-resource-allocation/devicemetadata of the release, into the
// release's newest version (v1beta1), with the release's validation of the object it read. One
// JSON line per file: {"path", "apiVersion" (the version it read), "validation" (its errors, ""),
// "metadata"}; exit 1 on a file it cannot decode. The tests (tests/metadatacheck.py) run it on the
// agent's files; `make metadata-check` (hack/metadata-check-bin.sh) builds it. Never commit the binary.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/dynamic-resource-allocation/api/metadata/v1beta1"
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
	var dm v1beta1.DeviceMetadata
	var gvk schema.GroupVersionKind
	var invalid error
	if err := devicemetadata.DecodeMetadataFromStream(json.NewDecoder(f), &dm,
		devicemetadata.DecodeMetadataStoreGVKResult(&gvk), devicemetadata.DecodeMetadataWithValidationResult(&invalid)); err != nil {
		return err
	}
	validation := ""
	if invalid != nil {
		validation = invalid.Error()
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{
		"path": path, "apiVersion": gvk.GroupVersion().String(), "validation": validation, "metadata": dm})
}
