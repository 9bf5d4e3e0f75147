"""kubeapi imports kubernetes_asyncio without its generated API and model classes, and the
package still works in full for anyone who uses them. Each check runs in a fresh interpreter,
since this test process has long imported kubernetes_asyncio."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, capture_output=True,
                         text=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_agent_imports_no_generated_classes() -> None:
    result = run("""
        import json, sys
        import gpudra_driver.kubeapi, gpudra_driver.publisher, gpudra_driver.rescan, gpudra_driver.agent_cmd
        generated = [m for m in sys.modules if m.startswith(("kubernetes_asyncio.client.models.",
                                                             "kubernetes_asyncio.client.api."))]
        print(json.dumps({"generated": generated, "count": len(sys.modules)}))
    """)
    assert result["generated"] == []


def test_the_full_package_is_still_there_and_shares_its_classes() -> None:
    result = run("""
        import json, sys
        from gpudra_driver import kubeapi, lazyk8s
        before = lazyk8s.is_loaded("kubernetes_asyncio.client")
        from kubernetes_asyncio import client, config, watch
        from kubernetes_asyncio.client import V1ObjectMeta
        from kubernetes_asyncio.client.exceptions import ApiException
        import kubernetes_asyncio
        print(json.dumps({
            "before": before,
            "after": lazyk8s.is_loaded("kubernetes_asyncio.client"),
            "api": client.CoreV1Api.__name__, "model": client.models.V1Pod.__name__,
            "meta": V1ObjectMeta(name="x").name,
            "same_exception": ApiException is kubeapi.ApiException is client.ApiException,
            "same_client": client.ApiClient is sys.modules["kubernetes_asyncio.client.api_client"].ApiClient,
            "watch": watch.Watch.__name__, "version": kubernetes_asyncio.__version__,
            "config": callable(config.new_client_from_config),
        }))
    """)
    assert result.pop("before") is False and result.pop("after") is True
    assert result.pop("version")
    assert result == {"api": "CoreV1Api", "model": "V1Pod", "meta": "x", "same_exception": True,
                      "same_client": True, "watch": "Watch", "config": True}


def test_nothing_changes_when_kubernetes_asyncio_was_imported_first() -> None:
    result = run("""
        import json
        import kubernetes_asyncio
        from gpudra_driver import lazyk8s
        print(json.dumps({"installed": lazyk8s.install(), "api": kubernetes_asyncio.client.CoreV1Api.__name__}))
    """)
    assert result == {"installed": False, "api": "CoreV1Api"}


def test_the_agent_skips_the_packages_it_never_uses() -> None:
    result = run("""
        import json, sys
        import gpudra_driver.kubeapi, gpudra_driver.agent_cmd
        print(json.dumps(sorted(m for m in ("kubernetes_asyncio.dynamic", "kubernetes_asyncio.stream",
                                            "kubernetes_asyncio.utils", "kubernetes_asyncio.watch", "pydoc")
                                if m in sys.modules)))
    """)
    assert result == []


def test_a_submodule_that_needs_the_root_first_still_imports() -> None:
    # dynamic reads kubernetes_asyncio.__version__ while it is itself being imported: that must not
    # run the root's __init__ (which imports dynamic again, circularly)
    result = run("""
        import json
        from gpudra_driver import kubeapi, lazyk8s
        from kubernetes_asyncio.dynamic import DynamicClient
        import kubernetes_asyncio
        print(json.dumps({"client": DynamicClient.__name__, "version": kubernetes_asyncio.__version__,
                          "root": lazyk8s.is_loaded("kubernetes_asyncio")}))
    """)
    assert result == {"client": "DynamicClient", "version": result["version"], "root": False}
    assert result["version"][0].isdigit()
