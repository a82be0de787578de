"""deploy/kubernetes: every manifest validates against the schema the Kubernetes API server would
check it with: KubeRay's CRDs for RayJob and RayCluster (vendored in tests/data/kuberay, at the
release the README installs), and a schema of the core kinds' fields we use (Secret,
PersistentVolumeClaim).

The CRDs' `openAPIV3Schema` is validated with jsonschema the way the API server reads it with
`kubectl apply` (strict field validation, kubectl's default): a field the schema does not name
is an error, not silently dropped; `nullable` allows null; `x-kubernetes-list-type: map` lists
have unique keys. Not checked: the CRDs' CEL rules (`x-kubernetes-validations`), which need a
CEL evaluator, and what KubeRay's controller validates on its own (tests in
test_deploy_manifests.py cover the parts that matter here).
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

yaml = pytest.importorskip("yaml", reason="PyYAML reads the manifests (the `test` extra)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema checks them (the `test` extra)")

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
KUBERAY = "v1.7.0"
CRDS = REPO / "tests" / "data" / "kuberay" / KUBERAY
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 2 MB

# ObjectMeta, as far as a manifest sets it: a DNS-1123 name, string labels and annotations.
STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 253,
                 "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
        "namespace": {"type": "string"}, "labels": STRINGS, "annotations": STRINGS,
    },
}
QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": r"^[0-9.]+[A-Za-z]*$"}]}
# The core kinds deploy/kubernetes holds, with the fields of theirs it may use.
CORE = {
    ("v1", "Secret"): {
        "type": {"type": "string"}, "immutable": {"type": "boolean"},
        "data": STRINGS, "stringData": STRINGS,
    },
    ("v1", "PersistentVolumeClaim"): {
        "spec": {"type": "object", "additionalProperties": False, "required": ["accessModes"],
                 "properties": {
                     "accessModes": {"type": "array", "minItems": 1, "items": {"enum": [
                         "ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]}},
                     "storageClassName": {"type": "string"},
                     "volumeMode": {"enum": ["Filesystem", "Block"]},
                     "volumeName": {"type": "string"},
                     "resources": {"type": "object", "additionalProperties": False,
                                   "properties": {
                                       "requests": {"type": "object", "required": ["storage"],
                                                    "additionalProperties": QUANTITY},
                                       "limits": {"type": "object",
                                                  "additionalProperties": QUANTITY}}}}},
    },
}


def _core_schema(api_version: str, kind: str) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False,
            "required": ["apiVersion", "kind", "metadata"],
            "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind},
                           "metadata": METADATA, **CORE[api_version, kind]}}


# ---------------------------------------------------------------------------- the CRDs


def _crds() -> dict[str, dict[str, Any]]:
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=Loader)
        assert crd["kind"] == "CustomResourceDefinition", path
        found[crd["spec"]["names"]["kind"]] = crd
    return found


CRD_BY_KIND = _crds()


def _strict(schema: Any) -> Any:
    """An openAPIV3Schema as JSON Schema that refuses what `kubectl apply` refuses."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if ("additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False  # strict field validation: unknown is an error
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    if "items" in out:
        out["items"] = _strict(out["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def _unique_map_keys(validator: Any, list_type: str, instance: Any,
                     schema: dict[str, Any]) -> Iterator[Any]:
    """x-kubernetes-list-type: map (unique x-kubernetes-list-map-keys) and set (unique items)."""
    if not isinstance(instance, list):
        return
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen = [tuple(item.get(k) for k in keys) for item in instance if isinstance(item, dict)]
    elif list_type == "set":
        seen = [repr(item) for item in instance]
    else:
        return
    duplicates = sorted({str(s) for s in seen if seen.count(s) > 1})
    if duplicates:
        yield jsonschema.ValidationError(f"duplicate {list_type} keys {duplicates}")


Validator = jsonschema.validators.extend(jsonschema.Draft4Validator,
                                         {"x-kubernetes-list-type": _unique_map_keys})


def _schema_for(doc: dict[str, Any]) -> dict[str, Any]:
    api_version, kind = doc.get("apiVersion", ""), doc.get("kind", "")
    if (api_version, kind) in CORE:
        return _core_schema(api_version, kind)
    crd = CRD_BY_KIND.get(kind)
    assert crd is not None, f"no schema for kind {kind!r}"
    group, _, version = api_version.partition("/")
    assert group == crd["spec"]["group"], f"{kind}: apiVersion {api_version}"
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    schema = _strict(served["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = METADATA
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"].pop("status", None)  # the operator's to write, never a manifest's
    return schema


def _errors(doc: dict[str, Any]) -> list[str]:
    validator = Validator(_schema_for(doc))
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                  for e in validator.iter_errors(doc))


# ---------------------------------------------------------------------------- the manifests


def _documents() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{path.name}:{doc.get('kind')}:{doc.get('metadata', {}).get('name')}", doc)
            for path in sorted(KUBERNETES.glob("*.y*ml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


DOCUMENTS = _documents()


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for _, d in DOCUMENTS if d["kind"] == kind]
    return doc


def test_the_vendored_crds_are_kuberays_files_at_the_named_release() -> None:
    readme = (CRDS.parent / "README.md").read_text()
    assert f"**{KUBERAY}**" in readme
    for path in sorted(CRDS.glob("*.yaml")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert re.search(rf"`{re.escape(path.name)}` \| `[0-9a-f]{{40}}` \| `{digest}`", readme), (
            f"{path.name} is not the file tests/data/kuberay/README.md names")
    assert sorted(CRD_BY_KIND) == ["RayCluster", "RayJob"]


def test_the_operator_the_readme_installs_is_the_one_the_crds_come_from() -> None:
    readme = (KUBERNETES / "README.md").read_text()
    installs = re.findall(r"helm install kuberay-operator \S+ --version (\S+)", readme)
    assert installs == [KUBERAY.removeprefix("v")], installs


@pytest.mark.parametrize("doc", [d for _, d in DOCUMENTS], ids=[n for n, _ in DOCUMENTS])
def test_every_manifest_validates_against_its_schema(doc: dict[str, Any]) -> None:
    assert _errors(doc) == []


# Each one a mistake the schemas catch, so that the validation above is known to bite.
MISTAKES: dict[str, tuple[str, Callable[[dict[str, Any]], None]]] = {
    "a misspelt field": ("RayJob", lambda d: d["spec"].update(backofLimit=2)),
    "a number where KubeRay wants a string": (
        "RayJob", lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]
        .update({"num-cpus": 0})),
    "a misspelt pod field": (
        "RayCluster", lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        .update(volumeMount=[])),
    "an auth mode KubeRay lacks": ("RayJob", lambda d: d["spec"]["rayClusterSpec"]["authOptions"]
                                   .update(mode="tokens")),
    "two containers of one name": (
        "RayCluster", lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]
        .append({"name": "ray-worker", "image": "x"})),
    "a string where an integer goes": ("RayCluster", lambda d: d["spec"]["workerGroupSpecs"][0]
                                       .update(replicas="3")),
    "an upper-case name": ("RayJob", lambda d: d["metadata"].update(name="Stalwart")),
    "a misspelt Secret field": ("Secret", lambda d: d.update(strinData=d.pop("stringData"))),
    "an access mode Kubernetes lacks": ("PersistentVolumeClaim", lambda d: d["spec"].update(
        accessModes=["ReadWriteAll"])),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_in_a_manifest_fails_validation(mistake: str) -> None:
    kind, change = MISTAKES[mistake]
    doc = copy.deepcopy(_one(kind) if kind != "Secret" else
                        next(d for _, d in DOCUMENTS if d["kind"] == "Secret"))
    assert _errors(doc) == []
    change(doc)
    assert _errors(doc), f"{mistake}: not caught"
