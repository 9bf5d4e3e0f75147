"""The shipped MIG catalogs (driver/gpudra_driver/profiles/mig/<model>.yaml) are internally consistent,
agree with each other where the GPUs do, and fit the simulated-NVML profiles that name them."""

from __future__ import annotations

from importlib import resources

import pytest

from gpudra_driver.nvml import profile_names
from gpudra_driver.nvml.fake import MigCatalog, gpu_instance_profile, load_mig_catalog, load_profile, mig_catalog_names

CATALOGS = ["a100-sxm4-40gb", "a100-sxm4-80gb", "b200-180gb", "h100-sxm5-80gb", "h200-sxm-141gb"]
# The GPU (NVML name) each catalog describes, as the shipped profiles name it.
MODEL_OF_GPU = {
    "NVIDIA A100-SXM4-40GB": "a100-sxm4-40gb",
    "NVIDIA A100-SXM4-80GB": "a100-sxm4-80gb",
    "NVIDIA H100 80GB HBM3": "h100-sxm5-80gb",
    "NVIDIA H200": "h200-sxm-141gb",
}
# NVML_GPU_INSTANCE_PROFILE_* index -> the profile ID NVML gives it: the same on all five GPUs
# (matched by name, slices, instances and placements across -lgip/-lgipp outputs).
ID_OF_INDEX = {0: 19, 7: 20, 9: 15, 1: 14, 2: 9, 3: 5, 4: 0}


def test_shipped_catalogs() -> None:
    assert mig_catalog_names() == CATALOGS


@pytest.fixture(params=CATALOGS)
def catalog(request: pytest.FixtureRequest) -> MigCatalog:
    return load_mig_catalog(request.param)


def test_geometry(catalog: MigCatalog) -> None:
    assert (catalog.memory_slices, catalog.compute_slices) == (8, 7)  # every MIG GPU so far
    for p in catalog.profiles:
        assert p.name.startswith(f"{p.slices}g."), p.name
        assert 1 <= p.slices <= catalog.compute_slices
        assert all(0 <= start and start + p.placement_size <= catalog.memory_slices for start in p.placement_starts)


def test_the_full_profile_covers_every_memory_slice(catalog: MigCatalog) -> None:
    full = [p for p in catalog.profiles if p.slices == catalog.compute_slices]
    assert len(full) == 1
    assert (full[0].placement_starts, full[0].placement_size, full[0].instances) == ((0,), catalog.memory_slices, 1)
    # ... and has the most of everything (NVIDIA's DRA driver takes its values as the GPU's counters)
    for p in catalog.profiles:
        for attr in ("multiprocessors", "copy_engines", "decoders", "encoders", "jpeg", "ofa", "memory_mib"):
            assert getattr(p, attr) <= getattr(full[0], attr), (p.name, attr)


def test_instances_and_placements(catalog: MigCatalog) -> None:
    for p in catalog.profiles:
        starts = p.placement_starts
        if p.name.endswith("+me"):
            # one instance (the GPU's only media extensions), placeable on any 1g slot: instances <
            # placements, as -lgip (1) and -lgipp ({0..6}:1) report; the facts override the simple rule
            base = catalog.by_name(p.name.removesuffix("+me"))
            assert base is not None and p.instances == 1
            assert (starts, p.placement_size, p.slices, p.memory_mib) == (
                base.placement_starts, base.placement_size, base.slices, base.memory_mib)
            continue
        assert p.instances == len(starts), p.name
        assert all(start % p.placement_size == 0 for start in starts), p.name  # aligned ...
        assert list(starts) == sorted(starts) and all(b - a >= p.placement_size for a, b in zip(starts, starts[1:]))


def test_memory_follows_the_memory_slices(catalog: MigCatalog) -> None:
    by_size: dict[int, set[int]] = {}
    for p in catalog.profiles:
        by_size.setdefault(p.placement_size, set()).add(p.memory_mib)
    assert all(len(sizes) == 1 for sizes in by_size.values()), by_size  # same slices, same memory
    ordered = [next(iter(by_size[size])) for size in sorted(by_size)]
    assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered)


def test_nvml_indexes_and_ids(catalog: MigCatalog) -> None:
    assert {p.index: p.id for p in catalog.profiles} == ID_OF_INDEX


def test_every_catalog_names_its_sources() -> None:
    for model in CATALOGS:
        text = (resources.files("gpudra_driver") / "profiles" / "mig" / f"{model}.yaml").read_text()
        assert text.startswith(f"# {model}: GPU instance profiles as NVML reports them")
        assert "# Sources" in text


def test_profiles_name_the_catalog_of_their_gpu() -> None:
    named = set()
    for name in profile_names():
        for gpu in load_profile(name).gpus:
            if not gpu.mig_capable:
                assert gpu.mig_catalog is None
                continue
            assert gpu.mig_catalog is not None, (name, gpu.uuid)
            assert gpu.mig_catalog.model == MODEL_OF_GPU[gpu.name], (name, gpu.name)
            full = max(gpu.mig_catalog.profiles, key=lambda p: p.slices)
            assert full.memory_mib <= gpu.memory_mib  # the 7g profile exposes less than the whole GPU
            named.add(gpu.mig_catalog.model)
    assert named == set(MODEL_OF_GPU.values())  # b200-180gb: no shipped profile yet


def test_static_mig_devices_match_their_catalog_profile() -> None:
    """A MIG device whose compute instance is its whole GPU instance has the profile's resources."""
    for name in profile_names():
        for gpu in load_profile(name).gpus:
            for mig in gpu.migs.values():
                assert gpu.mig_catalog is not None
                spec = gpu.mig_catalog.by_name(gpu_instance_profile(mig.profile))
                assert spec is not None
                a = mig.attributes
                assert a["gpuInstanceSliceCount"] == spec.slices and a["memorySizeMB"] == spec.memory_mib
                if a["computeInstanceSliceCount"] == spec.slices:
                    assert (a["multiprocessorCount"], a["sharedCopyEngineCount"], a["sharedDecoderCount"],
                            a.get("sharedEncoderCount", 0), a.get("sharedJpegCount", 0), a.get("sharedOfaCount", 0)) \
                        == (spec.multiprocessors, spec.copy_engines, spec.decoders, spec.encoders, spec.jpeg, spec.ofa)
