// cdi-validate checks CDI spec files with the official CDI Go library (tags.cncf.io/container-device-interface),
// the code container runtimes (containerd, CRI-O, podman) use to load specs and inject devices:
//
//  1. each file alone: cdi.ReadSpec (strict parsing that rejects unknown fields, the cdiVersion
//     its content needs, vendor/class/device name rules, annotations, container edits validation);
//  2. all files together in one CDI cache (one spec directory, one priority): no cache errors
//     (a device name defined twice in one kind conflicts), and every device of every spec resolvable;
//  3. each device injected alone into an empty OCI runtime spec (cache.InjectDevices), which also
//     stats the host path of every device node whose type and major are not given in the spec.
//
// Usage: cdi-validate [--json] SPEC_FILE...
//
//	cdi-validate --inject NAME[,NAME...] --spec-dir DIR [--spec-dir DIR...]
//
// Exit status 0 only when every check passes; 1 when one fails (one line per failure on stderr,
// naming the file or the device); 2 on a usage error. With --json, stdout is one JSON object:
// qualified device name ("vendor/class=name") -> the OCI runtime spec the device alone turns an
// empty one into (process.env, mounts, linux.devices, linux.resources.devices, hooks, ...).
//
// With --inject it does what a container runtime does with the CDI devices of one container:
// a CDI cache over the spec directories as containerd builds one (cdi.NewCache(WithSpecDirs(dirs...),
// WithAutoRefresh(false)): later directories take priority, and a spec file that fails to load
// only leaves its own devices undefined), then all the qualified names injected together into one
// empty OCI runtime spec (cache.InjectDevices, so spec-wide edits apply once per spec). stdout is
// that OCI spec as JSON. Exit status 1 when a name does not resolve or injection fails (the
// library's error, e.g. "unresolvable CDI devices ...", then the cache's spec file errors, on
// stderr); 2 on a usage error.
// Build it with hack/cdi-tools-bin.sh (`make cdi-tools`).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

func main() {
	os.Exit(run())
}

// stringList is a flag that may be given several times.
type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ",") }

func (l *stringList) Set(value string) error {
	*l = append(*l, value)
	return nil
}

func run() int {
	asJSON := flag.Bool("json", false, "print, per device, the OCI spec parts its injection gives an empty spec")
	inject := flag.String("inject", "", "inject these qualified CDI device names (comma-separated) into one empty OCI spec and print it")
	var specDirs stringList
	flag.Var(&specDirs, "spec-dir", "with --inject: a CDI spec directory (repeatable; later ones take priority)")
	flag.Usage = func() {
		name := filepath.Base(os.Args[0])
		fmt.Fprintf(flag.CommandLine.Output(), "usage: %s [--json] SPEC_FILE...\n", name)
		fmt.Fprintf(flag.CommandLine.Output(), "       %s --inject NAME[,NAME...] --spec-dir DIR [--spec-dir DIR...]\n", name)
		flag.PrintDefaults()
	}
	flag.Parse()
	if *inject != "" || len(specDirs) > 0 {
		if *inject == "" || len(specDirs) == 0 || *asJSON || flag.NArg() > 0 {
			flag.Usage()
			return 2
		}
		return injectDevices(strings.Split(*inject, ","), specDirs)
	}
	files := flag.Args()
	if len(files) == 0 {
		flag.Usage()
		return 2
	}

	failed := false
	fail := func(format string, args ...any) { // one line per failure: multi-line errors are joined
		failed = true
		lines := strings.Split(strings.TrimSpace(fmt.Sprintf(format, args...)), "\n")
		for i := range lines {
			lines[i] = strings.TrimSpace(lines[i])
		}
		fmt.Fprintln(os.Stderr, strings.Join(lines, " "))
	}

	specDir, err := os.MkdirTemp("", "cdi-validate-")
	if err != nil {
		fail("cdi-validate: %v", err)
		return 1
	}
	defer os.RemoveAll(specDir)

	// 1. Each file on its own; the good ones are copied into the one spec directory of the cache,
	// under unique names that keep the extension (the cache only scans .json and .yaml files).
	type loaded struct {
		file string
		spec *cdi.Spec
	}
	var specs []loaded
	original := map[string]string{} // copy in specDir -> the file given
	for i, file := range files {
		spec, err := cdi.ReadSpec(file, 0)
		if err != nil {
			fail("%s: %v", file, err)
			continue
		}
		ext := filepath.Ext(file)
		if ext != ".json" && ext != ".yaml" {
			fail("%s: a CDI spec file must be named *.json or *.yaml: a runtime's CDI cache ignores it", file)
			continue
		}
		data, err := os.ReadFile(file)
		if err != nil {
			fail("%s: %v", file, err)
			continue
		}
		copied := filepath.Join(specDir, fmt.Sprintf("%04d-%s", i, filepath.Base(file)))
		if err := os.WriteFile(copied, data, 0o600); err != nil {
			fail("%s: %v", file, err)
			continue
		}
		original[copied] = file
		specs = append(specs, loaded{file, spec})
	}
	// Messages about the copies name the files given instead.
	rename := func(message string) string {
		for copied, file := range original {
			message = strings.ReplaceAll(message, copied, file)
		}
		return message
	}

	// 2. All of them in one cache, as a runtime loads a CDI spec directory.
	cache, err := cdi.NewCache(cdi.WithSpecDirs(specDir), cdi.WithAutoRefresh(false))
	if err != nil {
		fail("CDI cache: %s", rename(err.Error()))
	}
	if cache == nil {
		return 1
	}
	cacheErrors := cache.GetErrors()
	for _, path := range slices.Sorted(maps.Keys(cacheErrors)) {
		name := path
		if file, ok := original[path]; ok {
			name = file
		}
		for _, err := range cacheErrors[path] {
			fail("%s: CDI cache: %s", name, rename(err.Error()))
		}
	}
	listed := map[string]bool{}
	for _, device := range cache.ListDevices() {
		listed[device] = true
	}

	// 3. Each device alone into an empty OCI spec.
	injected := map[string]*oci.Spec{}
	for _, s := range specs {
		for _, d := range s.spec.Devices {
			qualified := s.spec.Kind + "=" + d.Name
			if !listed[qualified] {
				fail("%s: device %s: not resolvable in the CDI cache (see the cache errors)", s.file, qualified)
				continue
			}
			ociSpec := &oci.Spec{}
			if unresolved, err := cache.InjectDevices(ociSpec, qualified); err != nil {
				fail("%s: device %s: %s", s.file, qualified, rename(err.Error()))
				continue
			} else if len(unresolved) > 0 {
				fail("%s: device %s: unresolved %v", s.file, qualified, unresolved)
				continue
			}
			injected[qualified] = ociSpec
		}
	}

	if *asJSON {
		out, err := json.Marshal(injected)
		if err != nil {
			fail("cdi-validate: %v", err)
		} else {
			fmt.Println(string(out))
		}
	}
	if failed {
		return 1
	}
	return 0
}

// injectDevices injects the qualified CDI device names together into one empty OCI spec, from a
// CDI cache over specDirs built like containerd's, and prints the result as JSON.
func injectDevices(names []string, specDirs []string) int {
	for _, name := range names {
		if strings.TrimSpace(name) == "" {
			fmt.Fprintln(os.Stderr, "cdi-validate: --inject: an empty CDI device name")
			return 2
		}
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(specDirs...), cdi.WithAutoRefresh(false))
	if cache == nil {
		fmt.Fprintf(os.Stderr, "CDI cache: %v\n", err)
		return 1
	}
	ociSpec := &oci.Spec{}
	if _, err := cache.InjectDevices(ociSpec, names...); err != nil {
		fmt.Fprintln(os.Stderr, err)
		// Like a runtime's log: why a device is missing is often a spec file that failed to load.
		cacheErrors := cache.GetErrors()
		for _, path := range slices.Sorted(maps.Keys(cacheErrors)) {
			for _, specErr := range cacheErrors[path] {
				fmt.Fprintf(os.Stderr, "CDI cache: %s: %s\n", path, strings.Join(strings.Fields(specErr.Error()), " "))
			}
		}
		return 1
	}
	out, err := json.Marshal(ociSpec)
	if err != nil {
		fmt.Fprintf(os.Stderr, "cdi-validate: %v\n", err)
		return 1
	}
	fmt.Println(string(out))
	return 0
}
