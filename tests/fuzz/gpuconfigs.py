"""Hypothesis strategies for GpuConfig parameters as a tenant writes them: mostly the shape of a
real config, so the draws reach every rule, with any JSON value wherever a value goes, unknown
fields, objects with one field too many, perDevice maps around their bound, and quantities of
every form ParseQuantity knows (huge and wrapping exponents, long digit strings, every suffix).

Only what JSON carries: string keys, no NaN or infinities, no lone surrogates (the API server
would read one back as U+FFFD, so the two sides would judge different strings)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from gpudra_driver.gpuconfig import API_VERSION, KIND

_TEXT = st.characters(exclude_categories=("Cs",))
texts = st.text(_TEXT, max_size=12)

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-200, 200),
    st.floats(allow_nan=False, allow_infinity=False), texts)
json_values = st.recursive(
    json_scalars, lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=8)


@st.composite
def mostly(draw: st.DrawFn, usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any], odds: int = 6) -> Any:
    """``usual``, and one time in ``odds`` ``odd``: most draws get past a value to the rules after it."""
    return draw(odd) if draw(st.integers(1, odds)) == odds else draw(usual)


_DIGITS = "0123456789"
_SUFFIXES = ("", "", "n", "u", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei",
             "K", "ki", "iB", "B", "e", "E+")
_EXPONENT_VALUES = (0, 3, 6, 9, 12, 18, 19, 20, 99, 100, 999, 300000, 1000000, 2**31 - 1, 2**31, 2**32 + 6,
                    2**63 - 1, 2**63, 10**30)


@st.composite
def exponents(draw: st.DrawFn) -> str:
    letter = draw(st.sampled_from("eE"))
    sign = draw(st.sampled_from(("", "", "+", "-")))
    value = draw(st.one_of(st.integers(0, 40), st.sampled_from(_EXPONENT_VALUES)))
    zeros = "0" * draw(st.sampled_from((0, 0, 0, 1, 3)))
    return f"{letter}{sign}{zeros}{value}"


@st.composite
def quantity_texts(draw: st.DrawFn) -> str:
    """``[sign] [digits] [. [digits]] [suffix | exponent]``, sometimes very long."""
    sign = draw(st.sampled_from(("", "", "", "+", "-")))
    integer = draw(st.one_of(st.text(_DIGITS, max_size=4), st.text(_DIGITS, min_size=5, max_size=70),
                             st.sampled_from(("9223372036854775807", "9223372036854775808", "1048575",
                                              "1048576", "0" * 60 + "1"))))
    fraction = draw(st.one_of(st.just(None), st.text(_DIGITS, max_size=12)))
    suffix = draw(st.one_of(st.sampled_from(_SUFFIXES), exponents()))
    return sign + integer + ("" if fraction is None else "." + fraction) + suffix


quantities = st.one_of(
    quantity_texts(), quantity_texts(),
    st.text("+-.0123456789eEinumkKMGTP", max_size=10),
    st.integers(0, 80).map(lambda n: "1" * n + "Mi"),
    st.sampled_from(("1Mi", "1023Ki", "8Ei", "16Ei", "1e300000", "1e2147483647", "2e4294967302",
                     "9" * 9000)))
memory_values = mostly(st.one_of(quantities, st.integers(2**20 - 2, 2**20 + 2), st.integers(-(2**65), 2**65)),
                       json_values)
percentages = mostly(st.one_of(st.integers(-2, 102), st.sampled_from((1, 50, 100, 50.0, "50", True))), json_values)
device_keys = st.one_of(
    st.sampled_from(("gpu-0", "gpu-1", "GPU-4f5e6d7c-1a2b-3c4d-5e6f-a1b2c3d4e5f6", "MIG-0a1b/1/0", "0", "Gpu-0",
                     "gpu-" + "a" * 59, "gpu-" + "a" * 60, "GPU-" + "a" * 61, "-gpu", "gpu.0")),
    st.from_regex(r"[a-z0-9]([-a-z0-9]{0,70}[a-z0-9])?", fullmatch=True),
    texts, st.integers(60, 200).map(lambda n: "k" * n))


def with_unknown_fields(known: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """``known``'s objects, sometimes with fields of other names, up to more than an object may have."""
    extra = mostly(st.just({}), st.one_of(st.dictionaries(texts, json_values, min_size=1, max_size=3),
                                          st.dictionaries(texts, json_values, min_size=7, max_size=9)), odds=8)
    return st.builds(lambda fields, more: {**more, **fields}, known, extra)


def objects_or_anything(known: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    return mostly(with_unknown_fields(known), json_values, odds=8)


mps_settings = st.fixed_dictionaries({}, optional={"activeThreadPercentage": percentages,
                                                   "pinnedMemoryLimit": memory_values})
per_device = mostly(st.dictionaries(device_keys, objects_or_anything(mps_settings), max_size=4),
                    st.one_of(st.dictionaries(device_keys, st.just({}), min_size=31, max_size=34), json_values))
mps = st.fixed_dictionaries({}, optional={"activeThreadPercentage": percentages, "pinnedMemoryLimit": memory_values,
                                          "perDevice": per_device, "shmSize": memory_values})
time_slicing = st.fixed_dictionaries({}, optional={"interval": mostly(
    st.sampled_from(("Default", "Short", "Medium", "Long", "long", "")), json_values)})
# The strategy and its block mostly agree, so the block's own rules are reached.
sharing = mostly(
    st.one_of(st.fixed_dictionaries({"strategy": st.just("MPS"), "mps": objects_or_anything(mps)}),
              st.fixed_dictionaries({"strategy": st.just("MPS"), "mps": objects_or_anything(mps)}),
              st.fixed_dictionaries({"strategy": st.just("MPS")}),
              st.fixed_dictionaries({"strategy": st.just("TimeSlicing")},
                                    optional={"timeSlicing": objects_or_anything(time_slicing)}),
              st.fixed_dictionaries({}, optional={"strategy": st.just("Exclusive")})),
    st.fixed_dictionaries({}, optional={
        "strategy": mostly(st.sampled_from(("Exclusive", "TimeSlicing", "MPS", "mps")), json_values),
        "timeSlicing": objects_or_anything(time_slicing), "mps": objects_or_anything(mps)}), odds=4)
parameters = with_unknown_fields(mostly(
    st.fixed_dictionaries({"apiVersion": mostly(st.just(API_VERSION), json_values, odds=12),
                           "kind": mostly(st.just(KIND), json_values, odds=12),
                           "sharing": objects_or_anything(with_unknown_fields(sharing))}),
    st.fixed_dictionaries({}, optional={"apiVersion": st.just(API_VERSION), "kind": st.just(KIND)}), odds=10))


def _limit_config(value: Any, key: str | None) -> dict[str, Any]:
    settings = {"pinnedMemoryLimit": value}
    mps_block = settings if key is None else {"perDevice": {key: settings}}
    return {"apiVersion": API_VERSION, "kind": KIND, "sharing": {"strategy": "MPS", "mps": mps_block}}


# A valid config but for one pinnedMemoryLimit, at the defaults or a device's: the quantity rules.
limit_configs = st.builds(_limit_config, memory_values, mostly(st.none(), st.just("gpu-0"), odds=3))
configs = st.one_of(parameters, limit_configs)
