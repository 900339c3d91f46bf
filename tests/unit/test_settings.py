"""A config key is declared once, on its settings field (default, check, meaning): conf/*.yaml and README's
configuration table agree with the fields key by key, and parse refuses a bad value of each kind of check with one
line naming `group.key`."""

import math
import re
from dataclasses import fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from k3dist.base.errors import K3Error
from k3dist.base.fault_injection import Faults
from k3dist.settings import CONFIGS, GROUPS, Settings, _resolved, parse

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
NOT_GROUP_KEYS = {"out", "fault.*"}  # README rows beside the groups' keys: result.json's path, the test-only faults


def _conf_file(group: str) -> Path:
    """The yaml a group's defaults come from (conf/config.yaml's defaults list)."""
    return CONF / "model" / "twin_0_40b.yaml" if group == "model" else CONF / group / "default.yaml"


def _load(path: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path))


def _default_job() -> dict:
    """The job Hydra composes with no override (its values as conf/ writes them)."""
    job = {group: _load(_conf_file(group)) for group in GROUPS}
    return job | {"fault": _load(CONF / "fault" / "none.yaml"), "out": None}


def _read(field, value, job: dict):
    """The value as its field holds it: the field's own check reads it."""
    return field.metadata["check"](value, job)


def test_every_field_declares_its_check_and_meaning():
    undeclared = [
        f"{group}.{f.name}"
        for group, cls in GROUPS.items()
        for f in fields(cls)
        if not callable(f.metadata.get("check")) or not f.metadata.get("help")
    ]
    assert not undeclared, f"declare these with checks.key(default, check, help): {undeclared}"


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_conf_yaml_and_the_fields_agree_key_by_key(group):
    path, job, cls = _conf_file(group), _default_job(), GROUPS[group]
    values, declared = job[group], [f.name for f in fields(cls)]
    missing = [f"{group}.{name}" for name in declared if name not in values]
    assert not missing, f"{path.relative_to(ROOT)} has no line for {missing}"
    undeclared = [f"{group}.{name}" for name in values if name not in declared]
    assert not undeclared, f"{path.relative_to(ROOT)}: {undeclared} have no field in {cls.__name__}"
    for f in fields(cls):
        read = _read(f, values[f.name], job)
        assert read == f.default, (
            f"{group}.{f.name}: {path.relative_to(ROOT)} says {values[f.name]!r} (read as {read!r}), "
            f"its field's default is {f.default!r}"
        )


def test_every_model_option_has_every_key_and_passes_its_checks():
    declared = [f.name for f in fields(GROUPS["model"])]
    for path in sorted((CONF / "model").glob("*.yaml")):
        values = _load(path)
        assert sorted(values) == sorted(declared), f"{path.relative_to(ROOT)}: keys {sorted(values)} != {declared}"
        assert values["name"] == path.stem, f"{path.relative_to(ROOT)}: model.name is not {path.stem!r}"
        parse(_default_job() | {"model": values})


def test_faults_yaml_and_dataclass_agree():
    values = _load(CONF / "fault" / "none.yaml")
    assert list(values) == [f.name for f in fields(Faults)]
    wrong = {name: v for name, v in values.items() if v != getattr(Faults(), name)}
    assert not wrong, f"conf/fault/none.yaml disagrees with Faults' defaults: {wrong}"


def test_config_yaml_composes_every_group_and_only_out_beside_them():
    top = _load(CONF / "config.yaml")
    groups = [next(iter(d)) for d in top["defaults"] if isinstance(d, dict)]
    assert sorted(groups) == sorted([*GROUPS, "fault"])
    assert set(top) == {"defaults", "hydra", "out"} and top["out"] is None


def test_parse_of_the_defaults_is_every_field_default_resolved():
    groups = {group: cls() for group, cls in GROUPS.items()}
    assert parse(_default_job()) == _resolved(Settings(**groups, out=None, fault=Faults()))


def _readme_rows() -> dict[str, tuple[str, str]]:
    """README's configuration table: key -> (default as written, meaning)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Configuration (`conf/`)")
    section = text[start : text.index("\n## ", start + 1)]
    rows = {}
    for line in section.splitlines():
        if m := re.fullmatch(r"\| `([\w.*]+)` \| `(.*?)` \| (.*) \|", line):
            assert m[1] not in rows, f"README's configuration table has two rows for {m[1]}"
            rows[m[1]] = (m[2], m[3])
    return rows


def test_readme_table_lists_every_key_with_its_default_and_meaning():
    rows, job = _readme_rows(), _default_job()
    declared = {f"{group}.{f.name}": f for group, cls in GROUPS.items() for f in fields(cls)}
    missing = [name for name in declared if name not in rows]
    assert not missing, f"README's configuration table has no row for {missing}"
    unknown = [name for name in rows if name not in declared and name not in NOT_GROUP_KEYS]
    assert not unknown, f"README's configuration table lists keys that do not exist: {unknown}"
    assert sorted(NOT_GROUP_KEYS) == sorted(name for name in rows if name not in declared)
    for name, f in declared.items():
        written, meaning = rows[name]
        read = _read(f, OmegaConf.create(f"v: {written}")["v"], job)
        assert read == f.default, (
            f"README: {name}'s default is `{written}` (read as {read!r}), its field's {f.default!r}"
        )
        assert meaning == f.metadata["help"], f"README: {name}'s meaning is not its field's help:\n{f.metadata['help']}"


NOT_A_BYTE_SIZE = "is not a byte size (use an int or e.g. 512MiB, 2GiB, 1GB)"
REFUSED = [  # one bad value per kind of check, and the special checks on their fields
    ("dist.nproc", "two", "must be an integer >= 1"),  # Int
    ("dist.world_size", 0, "must be an integer >= 1"),  # OrNull(Int)
    ("dist.timeout_s", 0.5, "must be a finite number in [1.0, inf)"),  # Number
    ("generate.temperature", math.nan, "must be a finite number in [0.0, inf)"),
    ("generate.top_p", 0, "must be a finite number in (0.0, 1.0]"),
    ("decode.compile", "maybe", "must be one of ['auto', 'on', 'off']"),  # Choice
    ("dist.check_tokens", "yes", "must be true or false"),  # Flag
    ("generate.system", 5, "must be a string"),  # Text
    ("memory.reserve", "lots", NOT_A_BYTE_SIZE),  # Size
    ("prefix.host_bytes", -5, "is negative"),
    ("generate.prompt", [], "must be text or a non-empty list of token ids"),
    ("generate.stop", ["a", ""], "must be a string or a list of non-empty strings"),
    ("model.config_file", "nope.json", f"names no config ({CONFIGS / 'nope.json'})"),
    ("serve.port", 70000, "must be a TCP port (0-65535; 0 picks a free one)"),
    ("serve.host", "", "must be an address to listen on, such as 127.0.0.1 or 0.0.0.0"),
    ("prefix.every", 100, "must be a multiple of generate.prefill_chunk=512, so snapshots fall on chunk ends"),
    (
        "serve.kv_events",
        "udp://x",
        "must be null or a ZMQ endpoint: tcp://*:5557 (bound), tcp://HOST:PORT (connected), ipc://PATH",
    ),  # fmt: skip
]


def _with(job: dict, name: str, value) -> dict:
    group, key = name.split(".")
    return job | {group: job[group] | {key: value}}


@pytest.mark.parametrize("name,value,why", REFUSED, ids=[r[0] for r in REFUSED])
def test_parse_refuses_a_bad_value_naming_the_key(name, value, why):
    with pytest.raises(K3Error) as refused:
        parse(_with(_default_job(), name, value))
    assert str(refused.value) == f"{name}={value!r} {why}"


def test_every_key_refuses_a_value_of_the_wrong_kind():
    job, wrong = _default_job(), {"a": 1}
    for group, cls in GROUPS.items():
        for f in fields(cls):
            name = f"{group}.{f.name}"
            if name == "model.path":  # any value, as its text
                continue
            with pytest.raises(K3Error) as refused:
                parse(_with(job, name, wrong))
            assert str(refused.value).startswith(f"{name}={wrong!r} "), (name, str(refused.value))


def test_fault_keys_are_checked():
    with pytest.raises(K3Error, match=r"^fault\.nope is not a fault \(known: "):
        parse(_default_job() | {"fault": {"nope": 1}})
    with pytest.raises(K3Error, match=re.escape(f"fault.free_drop='xx' {NOT_A_BYTE_SIZE}")):
        parse(_default_job() | {"fault": {"free_drop": "xx"}})


def test_values_read_into_what_the_fields_hold():
    job = _default_job()
    for name, value, held in [
        ("memory.reserve", "512MiB", 512 * 2**20),
        ("prefix.enabled", True, "on"),  # YAML reads a bare on as true
        ("generate.stop", "###", ("###",)),
        ("model.path", 123, "123"),
        ("serve.max_body", None, 0),
        ("dist.timeout_s", 30, 30.0),
    ]:
        group, key = name.split(".")
        assert getattr(getattr(parse(_with(job, name, value)), group), key) == held, name
    s = parse(_with(job, "model.path", "/some/dir"))  # a checkpoint dir: the config file is its own
    assert s.model.config_file == Path("Kimi-K3-0.40B-config.json")


def test_null_defaults_are_resolved_by_parse(monkeypatch):
    monkeypatch.delenv("K3DIST_API_KEY", raising=False)
    job = _default_job()
    s = parse(job)
    assert (s.decode.sync_every, s.prefix.every, s.serve.api_key) == (8, 4 * 512, None)
    assert parse(_with(job, "run.mode", "serve")).decode.sync_every == 1
    planned = _with(_with(job, "run.mode", "plan"), "run.plan_for", "serve")  # the what-if resolves as the server
    assert parse(planned).decode.sync_every == 1 and parse(_with(job, "run.mode", "plan")).decode.sync_every == 8
    assert parse(_with(job, "decode.sync_every", 3)).decode.sync_every == 3
    assert parse(_with(job, "generate.prefill_chunk", 64)).prefix.every == 256
    assert parse(_with(job, "serve.model_name", "")).serve.model_name is None
    monkeypatch.setenv("K3DIST_API_KEY", "from-env")
    assert parse(job).serve.api_key == "from-env"
    assert parse(_with(job, "serve.api_key", "given")).serve.api_key == "given"


def test_kv_events_need_prefix_reuse():
    job = _with(_with(_default_job(), "serve.kv_events", "tcp://*:5557"), "prefix.enabled", "off")
    with pytest.raises(K3Error) as refused:
        parse(job)
    assert str(refused.value) == "serve.kv_events='tcp://*:5557' publishes prefix snapshots, and prefix.enabled is off"
