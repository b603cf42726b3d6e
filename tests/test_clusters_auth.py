"""Every cluster config under clusters/ starts Ray with token authentication on every node,
and none of them carries the token itself.

Ray 2.60 leaves authentication off unless RAY_AUTH_MODE=token is set on each node: one
node group without it, or a token committed to the repository, opens the cluster to
anyone who reaches its ports. The checker reads the YAML as the launcher / KubeRay
would, so a comment or a README cannot satisfy it.
"""

import re
from pathlib import Path

import pytest
import yaml

CLUSTERS = Path(__file__).resolve().parent.parent / "clusters"

# A generated secret has no place in a committed file, whatever key or comment it sits
# under. Ray's own tokens are 64 hex digits (`ray get-auth-token --generate`), hand-made
# ones usually `openssl rand -hex 32` or `-base64 32`. Hex starts at 48 digits so that a
# pinned git commit (40, e.g. working_dir's archive/<sha>.zip) passes; so do image digests.
SECRET_LIKE = re.compile(r"""
    (?<![\w+/=-])(?<!sha256:)
    (?: [0-9a-fA-F]{48,}                                      # hex
      | [A-Za-z0-9+/]{30,}={1,2}                              # padded base64
      | (?=[\w-]*\d)(?=[\w-]*[A-Z])(?=[\w-]*[a-z])[\w-]{40,}   # long mixed-case random run
    )
    (?![\w+/=-])
""", re.VERBOSE)

# `RAY_AUTH_TOKEN=abc` in a command, `RAY_AUTH_TOKEN: abc` in an env_vars block (also
# inside runtimeEnvYAML, a string). `=$VAR` / `="$(...)"` read it at run time and are fine.
INLINE_TOKEN = re.compile(r"RAY_AUTH_TOKEN\s*[=:]\s*['\"]?(?![$'\"\s]|\{)")
# What precedes `ray start` in its command: an earlier `export RAY_AUTH_MODE=token`, or the
# assignment as a prefix of `ray start` itself (a prefix of `ulimit` would not reach it).
TOKEN_MODE_START = re.compile(
    r"(?:^|[\s;&|(])(?:export\s+RAY_AUTH_MODE=token\b.*|RAY_AUTH_MODE=token\s+(?:\w+=\S*\s+)*)$", re.S)


def walk(node, path=""):
    """Every (path, value) in a loaded YAML document, containers included."""
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, f"{path}[{i}]")


def inline_token_problems(text: str, docs: list) -> list[str]:
    problems = [f"line {text.count(chr(10), 0, m.start()) + 1}: secret-looking value {m.group()[:8]}..."
                for m in SECRET_LIKE.finditer(text)]
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "Secret" and (doc.get("data") or doc.get("stringData")):
            problems.append(f"Secret {doc.get('metadata', {}).get('name')} holds its values in the file")
        for path, node in walk(doc):
            if isinstance(node, dict) and node.get("name") == "RAY_AUTH_TOKEN" and "value" in node:
                problems.append(f"{path}: RAY_AUTH_TOKEN has an inline value")
            elif isinstance(node, dict) and isinstance(node.get("RAY_AUTH_TOKEN"), (str, int)):
                problems.append(f"{path}.RAY_AUTH_TOKEN is set inline")
            elif isinstance(node, str) and INLINE_TOKEN.search(node):
                problems.append(f"{path}: RAY_AUTH_TOKEN=<literal> in {node[:60]!r}")
    return problems


def launcher_problems(config: dict) -> list[str]:
    """A `ray up` config: each ray start (head and workers) in token mode, token file-mounted."""
    problems = []
    token_paths = {"~/.ray/auth_token"}  # where `ray start` looks when nothing says otherwise
    for group in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [cmd for cmd in config.get(group) or [] if "ray start" in cmd]
        if not starts:
            problems.append(f"{group}: no `ray start`")
        for cmd in starts:
            before_start = cmd.split("ray start")[0]
            if not TOKEN_MODE_START.search(before_start):
                problems.append(f"{group}: `ray start` without RAY_AUTH_MODE=token: {cmd[:70]!r}")
            token_paths.update(re.findall(r"RAY_AUTH_TOKEN_PATH=(\S+)", before_start))
    mounts = config.get("file_mounts") or {}
    mounted = [remote for remote in mounts if remote.rstrip("/") in token_paths]
    if not mounted:
        problems.append(f"file_mounts: nothing puts the token at {sorted(token_paths)} on the nodes")
    for remote in mounted:
        local = str(mounts[remote])
        # A relative source is inside the repository, i.e. a token file one `git add` from public.
        if not local.startswith(("~", "/")):
            problems.append(f"file_mounts[{remote!r}] copies the token from {local!r}, inside the repository")
    return problems


def container_has_token_env(container: dict) -> bool:
    env = {e.get("name"): e for e in container.get("env") or []}
    mode = env.get("RAY_AUTH_MODE", {}).get("value")
    token_ref = (env.get("RAY_AUTH_TOKEN", {}).get("valueFrom") or {}).get("secretKeyRef")
    return mode == "token" and bool(token_ref)


def ray_cluster_spec(doc: dict):
    spec = doc.get("spec") or {}
    return {"RayCluster": spec, "RayJob": spec.get("rayClusterSpec"),
            "RayService": spec.get("rayClusterConfig")}.get(doc.get("kind"))


def kuberay_problems(doc: dict) -> list[str]:
    """A KubeRay resource: authOptions on the cluster, or the token env from a Secret on every group."""
    name = f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}"
    spec = ray_cluster_spec(doc)
    if not spec:
        return [f"{name}: no Ray cluster spec to check"]
    # The operator then sets RAY_AUTH_MODE and RAY_AUTH_TOKEN on every Ray container itself.
    if (spec.get("authOptions") or {}).get("mode") == "token":
        return []
    groups = [("head", spec.get("headGroupSpec") or {})]
    groups += [(f"worker group {g.get('groupName')}", g) for g in spec.get("workerGroupSpecs") or []]
    problems = []
    for label, group in groups:
        containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers or not all(container_has_token_env(c) for c in containers):
            problems.append(f"{name}: {label} has no authOptions.mode=token and no "
                            "RAY_AUTH_MODE=token + RAY_AUTH_TOKEN from a secretKeyRef")
    return problems


def check(text: str) -> tuple[list[str], int]:
    """(problems, number of Ray clusters found) for one YAML file's text."""
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    problems, clusters = inline_token_problems(text, docs), 0
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        if "head_start_ray_commands" in doc or "available_node_types" in doc:
            problems += launcher_problems(doc)
            clusters += 1
        elif str(doc.get("apiVersion", "")).startswith("ray.io/"):
            problems += kuberay_problems(doc)
            clusters += 1
    return problems, clusters


YAML_FILES = sorted(p for p in CLUSTERS.iterdir() if p.suffix in (".yaml", ".yml"))


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_cluster_yaml_has_auth_on_every_node_and_no_inline_token(path):
    problems, _ = check(path.read_text())
    assert problems == []


def test_every_cluster_config_is_recognised_and_checked():
    # Guards the checker itself: a launcher or KubeRay file it failed to recognise would
    # pass above with nothing checked.
    found = {p.name: check(p.read_text())[1] for p in YAML_FILES}
    assert found["aws.yaml"] == found["gcp.yaml"] == found["kuberay-rayjob.yaml"] == 1


LAUNCHER_OK = """
file_mounts: {"~/.ray/auth_token": "~/.ray/auth_token"}
head_start_ray_commands: [ray stop, "ulimit -n 65536; RAY_AUTH_MODE=token ray start --head"]
worker_start_ray_commands: [ray stop, "RAY_AUTH_MODE=token ray start --address=$RAY_HEAD_IP:6379"]
"""
KUBERAY_NO_AUTH = """
apiVersion: ray.io/v1
kind: RayJob
metadata: {name: job}
spec:
  rayClusterSpec:
    headGroupSpec: {template: {spec: {containers: [{name: ray-head}]}}}
    workerGroupSpecs: [{groupName: gpu, template: {spec: {containers: [{name: ray-worker}]}}}]
"""
ENV_FROM_SECRET = """[{name: RAY_AUTH_MODE, value: token},
          {name: RAY_AUTH_TOKEN, valueFrom: {secretKeyRef: {name: tok, key: auth_token}}}]"""
KUBERAY_ENV = f"""
apiVersion: ray.io/v1
kind: RayCluster
metadata: {{name: c}}
spec:
  headGroupSpec: {{template: {{spec: {{containers: [{{name: ray-head, env: {ENV_FROM_SECRET}}}]}}}}}}
  workerGroupSpecs:
    - {{groupName: gpu, template: {{spec: {{containers: [{{name: ray-worker, env: {ENV_FROM_SECRET}}}]}}}}}}
"""


def test_checker_accepts_the_two_good_forms():
    assert check(LAUNCHER_OK) == ([], 1)
    assert check(KUBERAY_ENV) == ([], 1)


@pytest.mark.parametrize("text, expected", [
    (LAUNCHER_OK.replace("RAY_AUTH_MODE=token ray start --address", "ray start --address"),
     "worker_start_ray_commands: `ray start` without RAY_AUTH_MODE=token"),
    (LAUNCHER_OK.replace("ulimit -n 65536; RAY_AUTH_MODE=token ray", "RAY_AUTH_MODE=token ulimit -n 65536; ray"),
     "head_start_ray_commands: `ray start` without RAY_AUTH_MODE=token"),
    (LAUNCHER_OK.replace('"~/.ray/auth_token": "~/.ray/auth_token"', '"~/raysb": "."'),
     "nothing puts the token"),
    (LAUNCHER_OK.replace('"~/.ray/auth_token"}', '"./auth_token"}'), "inside the repository"),
    (LAUNCHER_OK.replace("token ray start --head", "token RAY_AUTH_TOKEN=hunter2 ray start --head"),
     "RAY_AUTH_TOKEN=<literal>"),
    (LAUNCHER_OK + "# token: " + "3f" * 32 + "\n", "secret-looking value"),
    (KUBERAY_NO_AUTH, "head has no authOptions"),
    (KUBERAY_NO_AUTH, "worker group gpu has no authOptions"),
    (KUBERAY_ENV.replace("valueFrom: {secretKeyRef: {name: tok, key: auth_token}}", "value: hunter2", 1),
     "RAY_AUTH_TOKEN has an inline value"),
    (KUBERAY_ENV.replace("valueFrom: {secretKeyRef: {name: tok, key: auth_token}}", "value: hunter2", 1),
     "head has no authOptions"),
    ("apiVersion: v1\nkind: Secret\nmetadata: {name: tok}\nstringData: {auth_token: hunter2}\n", "Secret tok holds"),
    ("env_vars: {RAY_AUTH_TOKEN: hunter2}\n", "RAY_AUTH_TOKEN is set inline"),
], ids=["worker-without-mode", "mode-on-another-command", "token-not-mounted", "token-from-repo",
        "token-in-command", "hex-in-comment", "kuberay-head-no-auth", "kuberay-worker-no-auth", "env-inline-value", "env-inline-not-secretref",
        "secret-manifest", "runtime-env-token"])
def test_checker_reports_a_planted_bad_document(text, expected):
    problems, _ = check(text)
    assert any(expected in p for p in problems), problems
