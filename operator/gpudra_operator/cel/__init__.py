"""CEL for DRA device selectors, evaluated the way the scheduler evaluates them.

Built on cel-expr-python (Google's cel-cpp bindings): its parser, type checker and runtime give
CEL's own semantics (errors absorbed by ``&&``/``||``, heterogeneous equality, overflow errors), and
the Kubernetes extensions are added here, one library per module, each citing its upstream source:

* :mod:`.opaque`: the ``Quantity``, ``Semver``, ``net.IP``, ``net.CIDR``, ``kubernetes.URL`` and
  ``kubernetes.NamedFormat`` value types (protobuf messages, so cel-cpp can carry them and compare
  them with ``==``);
* :mod:`.quantitylib`: ``quantity()`` and its members (k8s.io/apiserver/pkg/cel/library/quantity.go);
* :mod:`.semverlib`: ``semver()`` and its members (k8s.io/apiserver/pkg/cel/library/semverlib.go);
* :mod:`.listlib`: the Kubernetes list library, cel-go's sets and lists extensions;
* :mod:`.urlslib`: ``url()``, ``isURL`` and the URL getters (library/urls.go, Go's net/url);
* :mod:`.iplib`: ``ip()``, ``isIP``, ``ip.isCanonical`` and the IP members (library/ip.go, Go's
  net/netip);
* :mod:`.cidrlib`: ``cidr()``, ``isCIDR`` and the CIDR members (library/cidr.go);
* :mod:`.regexlib`: ``find`` and ``findAll`` (library/regex.go, Go's RE2 syntax, run by RE2);
* :mod:`.formatlib`: ``format.named``, ``format.<name>()`` and ``validate`` (library/format.go);
* :mod:`.astwalk`: the nodes of a checked expression, for the last two;
* :mod:`.cost`: the cost estimate the API server checks (cel-go's estimator with the Kubernetes
  and DRA sizes) and a bound of what the scheduler's run counts, so that a run the scheduler
  stops at the cost limit is never answered as a match or a miss;
* :mod:`.environment`: the environment the base set of k8s.io/apiserver/pkg/cel/environment/base.go
  and the DRA compiler (k8s.io/dynamic-resource-allocation/cel/compile.go) put together;
* :mod:`.selector`: compile a selector, build the ``device`` variable from a ResourceSlice device,
  evaluate; an error is "does not match, with an error", as the scheduler treats it.
"""

from gpudra_operator.cel.selector import (
    CompiledSelector,
    SelectorCompileError,
    SelectorResult,
    compile_selector,
    device_input,
)

__all__ = ["CompiledSelector", "SelectorCompileError", "SelectorResult", "compile_selector", "device_input"]
