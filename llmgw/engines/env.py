"""The environment every engine shares, and which variables a profile may not set.

Environment generation is where multi-node runs go wrong: one missing NCCL
variable turns a working tensor-parallel group into one that hangs on the
first all-reduce. The rules live here, once, for every adapter.

This module must NOT read os.environ: the agent passes its environment in as
`inherited`, so the same spec always yields the same command and tests need no
monkeypatching.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from llmgw.engines.spec import ShardSpec

__all__ = [
    "BASE_ENV_NAMES",
    "BASE_ENV_PREFIXES",
    "LLMGW_PREFIX",
    "OWNED_ENV",
    "UNSAFE_ENV",
    "UNSAFE_ENV_PREFIXES",
    "UNSAFE_ENV_SUFFIXES",
    "base_env_from",
    "is_secret_name",
    "materialize_env",
    "shard_env",
    "unsafe_env_reason",
]

LLMGW_PREFIX = "LLMGW_"

# Variables that make a process load or run code it names. The engine runs as
# the agent's user (often root), so a profile that sets one of these executes
# whatever the profile's author chose on every node that runs it. The node's
# own values (the unit file's LD_LIBRARY_PATH for CUDA) are still inherited:
# the operator of the node set those, not a catalog entry.
_CODE_LOADING: dict[str, str] = {
    # glibc's loader: preloads, audits or redirects libraries into the process.
    "LD_PRELOAD": "the dynamic loader injects the library it names",
    "LD_LIBRARY_PATH": "the dynamic loader resolves libraries from the directories it names",
    "LD_AUDIT": "the dynamic loader runs the audit library it names",
    # glibc loads iconv modules from here: the classic setuid escalation.
    "GCONV_PATH": "glibc loads character-conversion modules from it",
    # CUDA loads this library into every process that initialises it.
    "CUDA_INJECTION64_PATH": "the CUDA driver loads the library it names",
    "CUDA_INJECTION32_PATH": "the CUDA driver loads the library it names",
    # NCCL dlopens the plugin library named here.
    "NCCL_NET_PLUGIN": "NCCL loads the network plugin library it names",
    "NCCL_TUNER_PLUGIN": "NCCL loads the tuner plugin library it names",
    "NCCL_PROFILER_PLUGIN": "NCCL loads the profiler plugin library it names",
    # Python's import machinery and startup hooks.
    "PYTHONPATH": "Python imports modules from the directories it names",
    "PYTHONHOME": "Python loads its standard library from it",
    "PYTHONUSERBASE": "Python runs .pth files from the user site-packages under it",
    "PYTHONPYCACHEPREFIX": "Python loads cached bytecode from it",
    "PYTHONSTARTUP": "Python runs the file it names",
    "PYTHONINSPECT": "Python drops into an interactive prompt on exit",
    "PYTHONBREAKPOINT": "Python imports and calls the callable it names on breakpoint()",
    # A warning category like `mod.Class` makes Python import `mod` at startup.
    "PYTHONWARNINGS": "Python imports the modules its categories name",
    # Shells run these files or definitions before the engine's launcher script.
    "BASH_ENV": "bash runs the file it names",
    "ENV": "sh runs the file it names",
    "SHELLOPTS": "bash applies the shell options it names",
    "BASHOPTS": "bash applies the shell options it names",
    # Where programs and the files they load are looked up (hardening-3 finding 16). Each
    # points the engine at files of the profile author's choosing, which it then runs or
    # loads as code: the node's own values are inherited (BASE_ENV_NAMES), a profile's are
    # not, and HF_HOME stays settable (a model cache; code under it runs only with a
    # trust-remote-code flag, which the engine's own validation governs).
    "PATH": "the engine's launcher and the tools it runs (python, ninja, the C compiler) "
    "are looked up in the directories it names",
    "HOME": "Python runs the .pth files of the user site-packages under it, and tools "
    "read their configuration from it",
    "TMPDIR": "torch.compile and Triton compile kernels into the temporary directory and "
    "load them from it",
    "TMP": "Python takes its temporary directory from it (TMPDIR's reason)",
    "TEMP": "Python takes its temporary directory from it (TMPDIR's reason)",
    "OPENSSL_CONF": "OpenSSL loads the engines and providers its configuration file names",
    "OPENSSL_ENGINES": "OpenSSL loads engine libraries from the directory it names",
    "OPENSSL_MODULES": "OpenSSL loads provider libraries from the directory it names",
    "TORCH_EXTENSIONS_DIR": "torch loads the compiled extensions it finds there",
    "TORCHINDUCTOR_CACHE_DIR": "torch.compile loads the compiled kernels it finds there",
    "TRITON_CACHE_DIR": "Triton loads the compiled kernels and launchers it finds there",
    "TRITON_HOME": "Triton keeps its cache of compiled launchers under it",
    "TRITON_OVERRIDE_DIR": "Triton loads kernel overrides from it",
    "TRITON_PTXAS_PATH": "Triton runs the binary it names",
    "TRITON_CUOBJDUMP_PATH": "Triton runs the binary it names",
    "TRITON_NVDISASM_PATH": "Triton runs the binary it names",
    "TRITON_LIBCUDA_PATH": "Triton loads libcuda from the directory it names",
    "CC": "Triton and torch run the C compiler it names",
    "CXX": "torch runs the C++ compiler it names",
    "VLLM_CACHE_ROOT": "vLLM loads compiled graphs from it",
    "VLLM_CONFIG_ROOT": "vLLM reads its configuration files from it",
    "VLLM_LOGGING_CONFIG_PATH": "Python's logging configuration it names can instantiate any class",
    "HF_MODULES_CACHE": "transformers imports model code from it",
    "LOCPATH": "glibc loads locale files from it",
    "NLSPATH": "glibc loads message catalogs from it",
    # Other interpreters' code-loading switches, for engines' helper scripts.
    "NODE_OPTIONS": "node preloads the modules it names",
    "PERL5OPT": "perl runs the options it holds (-M loads modules)",
    "PERL5LIB": "perl imports modules from the directories it names",
    "PERLLIB": "perl imports modules from the directories it names",
    "RUBYOPT": "ruby runs the options it holds (-r loads code)",
    "RUBYLIB": "ruby loads code from the directories it names",
    "JAVA_TOOL_OPTIONS": "the JVM loads the agents it names",
    "_JAVA_OPTIONS": "the JVM loads the agents it names",
    # Developer switches that open endpoints or decoders to callers of the
    # engine: /collective_rpc and friends, pickle decoding, and loading LoRA
    # adapters from arbitrary paths at request time.
    "VLLM_SERVER_DEV_MODE": "vLLM exposes developer endpoints, /collective_rpc among them",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "vLLM unpickles data it receives",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "vLLM loads adapters from paths clients send",
}

# Prefixes of code-loading variables: every LD_* (and macOS's DYLD_*) steers
# the dynamic loader; BASH_FUNC_* are exported shell functions bash imports.
UNSAFE_ENV_PREFIXES: dict[str, str] = {
    "LD_": "the dynamic loader reads LD_* variables",
    "DYLD_": "the dynamic loader reads DYLD_* variables",
    "BASH_FUNC_": "bash imports exported functions from BASH_FUNC_* variables",
    # XDG_CONFIG_HOME, XDG_DATA_HOME, XDG_CACHE_HOME (Triton's and vLLM's caches of compiled
    # code fall back to it), XDG_*_DIRS: where programs find the files they load.
    "XDG_": "XDG_* variables say where programs find their configuration, data and caches "
    "of compiled code",
}

# Python reads every PYTHON* variable at startup, and new ones appear with new versions
# (PYTHONPLATLIBDIR relocates the standard library): only these switches, which change
# no file Python reads, may be set; the rest are refused by their prefix.
_PYTHON_SWITCHES: frozenset[str] = frozenset(
    {
        "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER",
        "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONNOUSERSITE", "PYTHONSAFEPATH",
        "PYTHONOPTIMIZE", "PYTHONDEVMODE", "PYTHONTRACEMALLOC", "PYTHONMALLOC",
        "PYTHONASYNCIODEBUG", "PYTHONINTMAXSTRDIGITS", "PYTHONWARNDEFAULTENCODING",
        "PYTHONCOERCECLOCALE", "PYTHONNODEBUGRANGES", "PYTHONVERBOSE",
    }
)  # fmt: skip

# A configuration file a process reads can name libraries, plugins or code to load
# (NCCL_CONF_FILE sets NCCL_NET_PLUGIN, a logging config instantiates classes): a profile
# names none; the engine's settings travel as flags and plain variables.
UNSAFE_ENV_SUFFIXES: tuple[str, ...] = ("_CONF", "_CONF_FILE", "_CONFIG_FILE", "_CONFIG_PATH")

# Variables llmgw sets itself. A profile value would silently undo a rule:
# another shard's GPUs, another fabric's HCAs, a KV hash seed the router does
# not use, an API key the gateway does not hold. The agent's own values are
# dropped too, so a shard never inherits the agent's GPUs or keys.
_OWNED: dict[str, str] = {
    "CUDA_VISIBLE_DEVICES": "llmgw pins each shard to the GPUs placement gave it",
    "CUDA_DEVICE_ORDER": "llmgw makes CUDA count GPUs in nvidia-smi's order, which placement uses",
    "NCCL_IB_HCA": "llmgw lists only the HCAs of the fabric placement chose",
    "NCCL_IB_GID_INDEX": "llmgw sets the RoCE GID index the agent discovered",
    "PYTHONHASHSEED": "llmgw sets it from profile.kv_hash.seed, which the router hashes with",
    "VLLM_API_KEY": "llmgw gives each shard its own API key",
    "VLLM_HOST_IP": "llmgw sets each rank's management address",
    # Another value would put a CPU shard on cores the agent gave another shard.
    "VLLM_CPU_OMP_THREADS_BIND": "llmgw binds each CPU shard to the cores the agent picked for "
    "it (profile.threads says how many)",
    "LLAMA_API_KEY": "llmgw gives each shard its own API key",
    "SIMENGINE_API_KEY": "llmgw gives each shard its own API key",
    # SGLang loads any flag from this file, the API key and bind address included.
    "SGLANG_CONFIG": "llmgw writes SGLang's config file, which carries the API key",
}

UNSAFE_ENV: frozenset[str] = frozenset(_CODE_LOADING) | frozenset(_OWNED)
OWNED_ENV: frozenset[str] = frozenset(_OWNED)


def unsafe_env_reason(name: str) -> str | None:
    """Why a profile may not set `name`, or None when it may."""
    if not name or "=" in name or "\0" in name:
        # exec's environment is "NAME=VALUE" strings: a name "PYTHONPATH=/x"
        # would set PYTHONPATH past every check on the name.
        return "it is not a valid variable name (empty, or contains '=' or NUL)"
    if name in _CODE_LOADING:
        return _CODE_LOADING[name]
    if name in _OWNED:
        return _OWNED[name]
    if name.startswith(LLMGW_PREFIX):
        # llmgw's own settings and the shard marker (LLMGW_SHARD_ID) the
        # wrapper stops processes by: a forged marker gets a process killed
        # with the wrong shard, or outlive its own.
        return "LLMGW_* variables belong to llmgw itself"
    for prefix, why in UNSAFE_ENV_PREFIXES.items():
        if name.startswith(prefix):
            return why
    if name.startswith("PYTHON") and name not in _PYTHON_SWITCHES:
        return (
            "Python reads PYTHON* variables at startup, and some load code or relocate "
            f"the files it loads; only {', '.join(sorted(_PYTHON_SWITCHES))} may be set"
        )
    if name.endswith(UNSAFE_ENV_SUFFIXES):
        return "a configuration file the process reads can name libraries or code to load"
    return None


def _owned_or_llmgw(name: str) -> bool:
    return name in _OWNED or name.startswith(LLMGW_PREFIX)


def shard_env(spec: ShardSpec, engine_vars: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables every engine is given for this shard: the shared rules, then
    the adapter's own `engine_vars`, then the profile's overrides.

    The rules:
    - CUDA_VISIBLE_DEVICES pins the shard to its GPUs, so two shards on one node
      cannot fight over a card; a shard with none gets an empty value, which
      hides every GPU rather than letting a CPU engine grab one.
    - NCCL_IB_HCA lists only the chosen fabric's adapters. Unset, NCCL picks
      adapters of another fabric where the peer is unreachable, and hangs.
    - NCCL_SOCKET_IFNAME pins bootstrap to the management interface; NCCL
      otherwise probes every interface, IB-over-IP ones that do not route
      between fabrics included.
    - NCCL_IB_DISABLE is set when there is no fabric, so NCCL stops looking for
      one instead of timing out.
    """
    devices = spec.gpu_uuids if spec.gpu_uuids else tuple(str(i) for i in spec.gpu_indices)
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(devices),
        # nvidia-smi counts by PCI bus, CUDA fastest-first unless told: on a
        # node with two kinds of GPU the shard would get another card than the
        # one placement gave it, which another shard may hold.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    if spec.hcas:
        env["NCCL_IB_HCA"] = ",".join(spec.hcas)
        env["NCCL_IB_DISABLE"] = "0"
        # RoCE: the routable RoCE v2 entry. A v1 link-local default hangs.
        if spec.gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(spec.gid_index)
    else:
        env["NCCL_IB_DISABLE"] = "1"
    # Inside a multi-node NVLink domain NCCL carries collectives over NVLink
    # between nodes only when told to, and needs cuMem (IMEX) handles for it.
    if spec.nnodes > 1 and spec.fabric.startswith("nvl:"):
        env["NCCL_MNNVL_ENABLE"] = "1"
        env["NCCL_CUMEM_ENABLE"] = "1"
    if spec.mgmt_interface:
        env["NCCL_SOCKET_IFNAME"] = spec.mgmt_interface
        env["GLOO_SOCKET_IFNAME"] = spec.mgmt_interface
    env.update(engine_vars or {})
    # Profile overrides win, except unsafe ones: checked again here and not
    # only when the profile was defined, because this is the process about to
    # run as root, whatever sent the profile.
    for k, v in spec.profile.env.items():
        if unsafe_env_reason(k) is None and "\0" not in v:
            env[k] = v
    return env


def materialize_env(
    inherited: Mapping[str, str], generated: Mapping[str, str], spec: ShardSpec
) -> dict[str, str]:
    """The complete, sorted environment of one command.

    Inheriting the agent's environment matters: engines need PATH, HOME,
    HF_HOME and the LD_LIBRARY_PATH the operator set up in the unit file. What
    llmgw owns is dropped from it first (a CPU shard must not inherit the
    agent's CUDA_VISIBLE_DEVICES, nor any engine the agent's LLMGW_* token).
    Secrets come last and pass the same unsafe-name filter as profile env.
    """
    merged = {k: v for k, v in inherited.items() if not _owned_or_llmgw(k)}
    merged.update(generated)
    for k, v in spec.secret_env.items():
        if unsafe_env_reason(k) is None and "\0" not in v:
            merged[k] = v
    return dict(sorted(merged.items()))


# What an engine inherits from the agent (or from `llmgw engines command`'s
# shell): an allow-list, not the whole environment minus some names. An
# operator's shell or a unit file carries AWS_SECRET_ACCESS_KEY, GITHUB_TOKEN,
# a database URL with its password; inheriting everything handed those to
# every engine and printed them in `llmgw engines command` (issue 8 item 7).
# Kept: what a process needs to run at all (PATH, HOME, user, locale, time
# zone, temp dir), where the operator put CUDA and the caches engines fill
# (Hugging Face, torch, Triton, vLLM compile caches: without them every
# start downloads or compiles again), CA bundles, and NCCL/Gloo tuning the
# node's operator set. Not kept: proxies (their URLs carry credentials; set
# them in the profile's env or secret_env), and anything else; a profile's
# env is the way to give an engine more.
BASE_ENV_NAMES: frozenset[str] = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR",
        "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH",
        "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_CACHE",
        "TRANSFORMERS_CACHE", "TRANSFORMERS_OFFLINE", "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME",
        "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    }
)  # fmt: skip
BASE_ENV_PREFIXES: tuple[str, ...] = ("LC_", "NCCL_", "GLOO_")

# Names that hold credentials by convention: a word anywhere in the name, or
# a vendor prefix whose variables are mostly keys. Matching errs towards
# hiding: a redacted harmless value costs a second look, a printed key is a leak.
_SECRET_WORDS = re.compile(
    r"TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|PASS$|_PASS_|KEY|CREDENTIAL|AUTH|COOKIE|"
    r"SESSION|PRIVATE|SIGNATURE|DSN|DATABASE_URL|CONN_?STR",
)
_SECRET_PREFIXES = (
    "AWS_", "AZURE_", "GCP_", "GOOGLE_", "GITHUB_", "GH_", "GITLAB_", "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN", "OPENAI_", "ANTHROPIC_", "WANDB_", "NPM_", "PYPI_", "DOCKER_",
    "SLACK_", "STRIPE_", "VAULT_", "PG", "MYSQL_", "REDIS_", "SENTRY_",
)  # fmt: skip


def is_secret_name(name: str) -> bool:
    """Whether a variable (or flag) name looks like it holds a credential."""
    upper = name.upper().lstrip("-").replace("-", "_")
    return bool(_SECRET_WORDS.search(upper)) or upper.startswith(_SECRET_PREFIXES)


def base_env_from(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of a process environment every engine inherits, sorted by name.

    The agent passes its own environment through this, and so does
    `llmgw engines command`, so what an operator is shown is what runs.
    Allowed names that still look secret (NCCL_..._KEY, say) are dropped too.
    """
    kept = {
        k: v
        for k, v in environ.items()
        if (k in BASE_ENV_NAMES or k.startswith(BASE_ENV_PREFIXES))
        and not is_secret_name(k)
        and "\0" not in v
    }
    return dict(sorted(kept.items()))
