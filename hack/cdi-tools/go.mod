// cdi-validate: checks CDI spec files with the official CDI Go library, the code container runtimes
// load specs and inject devices with. `make cdi-tools` (hack/cdi-tools-bin.sh) builds it; the tests
// (tests/cdispec.py) run it on every CDI spec they validate. Never commit the binary.
module gpudra.io/hack/cdi-tools

go 1.23.0

require (
	github.com/opencontainers/runtime-spec v1.3.0
	tags.cncf.io/container-device-interface v1.1.2
)

require (
	github.com/fsnotify/fsnotify v1.7.0 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/sys v0.19.0 // indirect
	tags.cncf.io/container-device-interface/specs-go v1.1.1 // indirect
)
