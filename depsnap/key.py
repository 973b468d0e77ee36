"""The key of a dependency snapshot: a digest of everything that decides what an install leaves behind.

:func:`compute_key` reads an install command (``pip install ...``, ``python -m pip
install ...``, ``uv pip install|sync ...``, ``uv sync``, or any other command with its
inputs named by ``extra_files``) and collects its inputs as named, printable values:

* the **base** it installs onto: on bare metal the interpreter (path, version,
  implementation, ABI, platform, libc) and a digest of the prefix's prior contents
  (:mod:`depsnap.content`: paths, types, modes, sizes, file contents and link
  targets, never mtimes or owners, and no derived bytecode, so a venv made at another
  time or on another node agrees); in a container the ChainID of the image layers
  below, which fixes the interpreter too;
* the **scope** (bare metal ``--scope``); a container's key is scoped by the
  snapshotter to the containerd namespace and its configured scope
  (:func:`container_store_key`);
* the **command** (argv, verbatim) and the installer's version;
* the full **contents** of every requirement, constraint, override and lock file it
  reads, nested ``-r``/``-c`` followed (paths relative to the including file),
  ``${VAR}`` references in them (the variables' values), local path requirements
  (a digest of the tree) and find-links directories (their listing: names and sizes);
* **index URLs** and find-links from argv, requirement files, pip/uv configuration
  files (their whole contents) and the environment, with credentials stripped;
* the **environment variables** that change an install: see :data:`PYTHON_VARS`,
  :data:`OTHER_VARS` and the ``PIP_*``/``UV_*`` exclusions, each with its reason.

The key is the SHA-256 of the canonical JSON of the inputs.  Everything here is
read-only and fast (a ``python -c`` probe of the interpreter, hashing the files);
bad input (a requirement file that is missing or nests too deep) raises
:class:`DepsKeyError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from bootseer.profile import traced

from .content import TreeError, file_digest, tree_digest

#: Bumped when the meaning of an input changes, so old keys are never matched by new code.
#: 2: the prior content leaves derived bytecode out (depsnap/content.py); scopes; containers' store keys.
KEY_VERSION = 2
#: A scope (``--scope``, the daemon's ``[depsnap] scope``): a short name, printable without quoting.
_SCOPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")

#: ``PYTHON*`` variables that change what an install writes, and why:
PYTHON_VARS = {
    "PYTHONPATH": "packages on it count as installed, so the resolver skips them",
    "PYTHONHOME": "moves the interpreter's prefix and its site-packages",
    "PYTHONNOUSERSITE": "whether the user site counts as installed",
    "PYTHONUSERBASE": "where the user site is (what counts as installed; --user installs)",
    "PYTHONPLATLIBDIR": "the name of the lib directory packages are installed into",
    "PYTHONPYCACHEPREFIX": "bytecode goes to another tree instead of __pycache__ in the prefix",
    "PYTHONDONTWRITEBYTECODE": "whether builds run during the install (sdists, uv) leave bytecode",
    "PYTHONOPTIMIZE": "the optimisation level of the bytecode written (.opt-1.pyc names)",
}
#: Other variables that change what an install writes.
OTHER_VARS = {
    "SOURCE_DATE_EPOCH": "bytecode is written with checked-hash invalidation instead of timestamps",
    "VIRTUAL_ENV": "uv installs into the active virtual environment",
    "CONDA_PREFIX": "uv installs into the active conda environment",
}
#: ``PIP_*`` variables that do not change the installed result (output, caching, network tuning,
#: credentials); every other ``PIP_*`` variable is an input, as pip reads each as an option.
PIP_IGNORED = frozenset({
    "PIP_NO_COLOR", "PIP_PROGRESS_BAR", "PIP_VERBOSE", "PIP_QUIET", "PIP_LOG", "PIP_LOG_FILE", "PIP_CACHE_DIR",
    "PIP_NO_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_NO_INPUT", "PIP_TIMEOUT", "PIP_RETRIES",
    "PIP_RESUME_RETRIES", "PIP_ROOT_USER_ACTION", "PIP_PROXY", "PIP_CERT", "PIP_CLIENT_CERT",
    "PIP_KEYRING_PROVIDER", "PIP_NO_PYTHON_VERSION_WARNING", "PIP_REQUIRE_VIRTUALENV", "PIP_TRUSTED_HOST",
    "PIP_DEFAULT_TIMEOUT",
})  # fmt: skip
#: ``UV_*`` variables that do not change the installed result; every other ``UV_*`` one is an input.
UV_IGNORED = frozenset({
    "UV_CACHE_DIR", "UV_NO_CACHE", "UV_NO_PROGRESS", "UV_CONCURRENT_DOWNLOADS", "UV_CONCURRENT_BUILDS",
    "UV_CONCURRENT_INSTALLS", "UV_HTTP_TIMEOUT", "UV_REQUEST_TIMEOUT", "UV_HTTP_RETRIES", "UV_NATIVE_TLS",
    "UV_LINK_MODE", "UV_NO_WRAP", "UV_KEYRING_PROVIDER", "UV_LOG_CONTEXT", "UV_INSECURE_HOST", "UV_COLOR",
})  # fmt: skip
#: ``UV_INDEX_<NAME>_USERNAME``/``_PASSWORD``: credentials, never part of a key (they rotate).
_UV_CREDENTIAL = re.compile(r"^UV_INDEX_.+_(USERNAME|PASSWORD)$")

#: Nested requirement files deeper than this are refused (a cycle is caught before).
MAX_NESTING = 32
_ENV_REFERENCE = re.compile(r"\$\{([A-Z0-9_]+)\}")
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")

_PROBE = r"""
import json, os, platform, sys, sysconfig
# Cheap first, the same values: pip's own __version__ (importlib.metadata scans every
# distribution on the path) and glibc's confstr (platform.libc_ver() reads the binary).
try:
    import pip as p
    pip = p.__version__
except Exception:
    try:
        import importlib.metadata as m
        pip = m.version("pip")
    except Exception:
        pip = ""
try:
    libc = os.confstr("CS_GNU_LIBC_VERSION").replace(" ", "-", 1)
except (AttributeError, ValueError, OSError):
    libc = None
if not libc:
    libc = "-".join(platform.libc_ver())
print(json.dumps({
    "executable": sys.executable, "version": platform.python_version(),
    "implementation": sys.implementation.name, "cache_tag": sys.implementation.cache_tag or "",
    "abi": sysconfig.get_config_var("SOABI") or "", "abiflags": getattr(sys, "abiflags", ""),
    "platform": sysconfig.get_platform(), "machine": platform.machine(),
    "libc": libc, "prefix": sys.prefix, "pip": pip,
}))
"""


class DepsKeyError(ValueError):
    """The key cannot be computed: a missing or unreadable input, a bad command."""


@dataclass
class DepsKey:
    """A key and the inputs it was computed from (name -> printable value, in the order collected)."""

    key: str  #: 64 hex digits
    inputs: dict[str, str]
    python: str = ""  #: the interpreter the install runs with ("" in a container: the base fixes it)

    def describe(self) -> str:
        width = max((len(name) for name in self.inputs), default=0)
        lines = [f"key {self.key}"]
        lines += [f"  {name.ljust(width)}  {value}" for name, value in self.inputs.items()]
        return "\n".join(lines)


@dataclass
class _Collector:
    cwd: Path
    env: Mapping[str, str]
    inputs: dict[str, str] = field(default_factory=dict)
    seen_files: set[Path] = field(default_factory=set)

    def add(self, name: str, value: str) -> None:
        if name in self.inputs and self.inputs[name] != value:
            name = f"{name}#{sum(1 for n in self.inputs if n.startswith(name))}"
        self.inputs[name] = value

    def resolve(self, path: str, relative_to: Path | None = None) -> Path:
        p = Path(os.path.expanduser(path))
        return p if p.is_absolute() else (relative_to or self.cwd) / p


def strip_credentials(url: str) -> str:
    """``url`` without ``user:password@`` (credentials rotate and must never be printed)."""
    if not _URL.match(url):
        return url
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def _tree(path: Path, *, skip: Iterable[str] = ()) -> str:
    """:func:`tree_digest` with its errors as DepsKeyError (what the key's callers report)."""
    try:
        return tree_digest(path, skip=skip)
    except TreeError as exc:
        raise DepsKeyError(str(exc)) from None


def find_links_digest(path: Path) -> str:
    """A find-links directory's listing (names and sizes: wheel names carry their versions)."""
    try:
        names = sorted(os.listdir(path))
    except FileNotFoundError:
        return "absent"
    except NotADirectoryError:
        return file_digest(path)
    listing = [[n, os.lstat(path / n).st_size] for n in names]
    return "sha256:" + hashlib.sha256(json.dumps(listing).encode()).hexdigest() + f" ({len(names)} files)"


# -- commands --------------------------------------------------------------------------------

#: Options of ``pip install`` that take a value (so their value is not read as a requirement).
_PIP_VALUE_OPTIONS = frozenset({
    "-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-t", "--target", "--platform",
    "--python-version", "--implementation", "--abi", "--root", "--prefix", "--src", "--upgrade-strategy",
    "-C", "--config-settings", "--global-option", "--no-binary", "--only-binary", "--progress-bar",
    "--root-user-action", "--report", "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--log",
    "--proxy", "--retries", "--timeout", "--exists-action", "--trusted-host", "--cert", "--client-cert",
    "--cache-dir", "--python", "--keyring-provider", "--use-feature", "--use-deprecated", "--group",
    "--build-constraint", "--resume-retries", "--uploaded-prior-to", "--log-file",
})  # fmt: skip
_UV_VALUE_OPTIONS = frozenset({
    "-r", "--requirements", "--requirement", "-c", "--constraints", "--constraint", "--overrides", "--override",
    "-e", "--editable", "-i", "--index-url", "--extra-index-url", "--index", "--default-index", "-f",
    "--find-links", "-p", "--python", "--target", "--prefix", "-C", "--config-setting", "--python-version",
    "--python-platform", "--index-strategy", "--resolution", "--prerelease", "--exclude-newer", "--link-mode",
    "--cache-dir", "--keyring-provider", "-P", "--upgrade-package", "--reinstall-package", "--no-binary",
    "--only-binary", "--config-file", "--directory", "--project", "--group", "--extra", "--build-constraints",
    "--refresh-package", "--no-build-package", "--no-binary-package", "--only-binary-package",
    "--allow-insecure-host", "--torch-backend", "--color", "--package", "--no-install-package",
})  # fmt: skip
_REQUIREMENT_FLAGS = {"-r": "requirements", "--requirement": "requirements", "--requirements": "requirements",
                      "-c": "constraints", "--constraint": "constraints", "--constraints": "constraints",
                      "--overrides": "overrides", "--override": "overrides",
                      "--build-constraint": "constraints", "--build-constraints": "constraints"}  # fmt: skip
_INDEX_FLAGS = {"-i": "index-url", "--index-url": "index-url", "--extra-index-url": "extra-index-url",
                "--index": "index", "--default-index": "index-url"}  # fmt: skip
_FIND_LINKS_FLAGS = {"-f", "--find-links"}


def _options(args: Sequence[str], value_options: frozenset[str]) -> list[tuple[str, str | None]]:
    """``args`` as (option, value) pairs and (None-option) positionals: ``("", arg)``."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out += [("", a) for a in args[i + 1 :]]
            break
        if arg.startswith("--") and "=" in arg:
            name, _, value = arg.partition("=")
            out.append((name, value))
        elif arg in value_options:
            if i + 1 >= len(args):
                raise DepsKeyError(f"option {arg} needs a value")
            out.append((arg, args[i + 1]))
            i += 1
        elif len(arg) > 2 and arg[0] == "-" and arg[1] != "-" and arg[:2] in value_options:
            out.append((arg[:2], arg[2:]))  # -rrequirements.txt
        elif arg.startswith("-"):
            out.append((arg, None))
        else:
            out.append(("", arg))
        i += 1
    return out


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "/", "~")) or os.sep in text or text.endswith((".whl", ".tar.gz", ".zip"))


def _tool(argv: Sequence[str], env: Mapping[str, str]) -> tuple[str, list[str], str | None]:
    """(``pip``/``uv-pip``/``uv-sync``/``other``, the installer's own arguments, the interpreter argv names)."""
    name = os.path.basename(argv[0])
    if re.fullmatch(r"python[0-9.]*", name) and len(argv) >= 3 and argv[1] == "-m" and argv[2] == "pip":
        rest = list(argv[3:])
        return ("pip", rest[1:] if rest[:1] == ["install"] else rest, argv[0])
    if re.fullmatch(r"pip[0-9.]*", name):
        rest = list(argv[1:])
        return ("pip", rest[1:] if rest[:1] == ["install"] else rest, None)
    if name == "uv":
        rest = list(argv[1:])
        if rest[:2] in (["pip", "install"], ["pip", "sync"]):
            return ("uv-pip-" + rest[1], rest[2:], None)
        if rest[:1] == ["sync"]:
            return ("uv-sync", rest[1:], None)
    return ("other", list(argv[1:]), None)


def _which(program: str, env: Mapping[str, str]) -> str | None:
    if os.sep in program:
        return os.path.abspath(program)
    return shutil.which(program, path=env.get("PATH", os.defpath))


def find_interpreter(argv: Sequence[str], env: Mapping[str, str], prefix: Path | None) -> str:
    """The interpreter an install command runs with (best effort; ``--python`` makes it exact)."""
    kind, args, python = _tool(argv, env)
    if python is not None:
        found = _which(python, env)
        if found:
            return found
    if kind == "pip":
        script = _which(argv[0], env)
        if script:
            with open(script, "rb") as f:
                first = f.readline(4096)
            if first.startswith(b"#!"):
                words = shlex.split(first[2:].decode(errors="replace"))
                if words and os.path.basename(words[0]) == "env" and len(words) > 1:
                    words = [_which(words[1], env) or words[1]]
                if words:
                    return words[0]
    if kind.startswith("uv"):
        for option, value in _options(args, _UV_VALUE_OPTIONS):
            if option in ("-p", "--python") and value:
                return _which(value, env) or value
        for candidate in (env.get("UV_PYTHON"), env.get("VIRTUAL_ENV") and f"{env['VIRTUAL_ENV']}/bin/python",
                          prefix and str(prefix / "bin" / "python")):  # fmt: skip
            if candidate and (os.sep in candidate and os.path.exists(candidate) or _which(candidate, env)):
                return _which(candidate, env) or candidate
    return _which("python3", env) or "python3"


def probe_interpreter(python: str) -> dict[str, str]:
    """Version, implementation, ABI, platform, libc and pip version of ``python``."""
    try:
        out = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
    except FileNotFoundError:
        raise DepsKeyError(f"interpreter {python} does not exist (give --python)") from None
    except subprocess.CalledProcessError as exc:
        raise DepsKeyError(f"interpreter {python} failed: {exc.stderr.strip()[-500:]}") from None
    return json.loads(out.stdout)


def _uv_version(env: Mapping[str, str], argv0: str) -> str:
    uv = _which(argv0, env)
    if uv is None:
        raise DepsKeyError(f"{argv0} is not on PATH")
    out = subprocess.run([uv, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or f"unknown ({file_digest(Path(uv))})"


# -- requirement files ---------------------------------------------------------------------


def _requirement_lines(text: str) -> Iterable[tuple[int, str]]:
    """Logical lines of a requirement file: continuations joined, comments stripped (pip's rules)."""
    buffered, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not buffered:
            start = number
        if line.endswith("\\") and not line.endswith("\\\\"):
            buffered += line[:-1]
            continue
        line = buffered + line
        buffered = ""
        line = re.sub(r"(^|\s+)#.*$", "", line).strip()
        if line:
            yield start, line
    if buffered.strip():
        yield start, buffered.strip()


def _read_requirement_file(c: _Collector, path: Path, what: str, depth: int, where: str) -> None:
    if _URL.match(str(path)):
        c.add(f"{what}-url", strip_credentials(str(path)))
        return
    path = path.resolve()
    if depth > MAX_NESTING:
        raise DepsKeyError(f"{where}: requirement files nest deeper than {MAX_NESTING}")
    if path in c.seen_files:
        return  # pip follows a file once per chain; its contents are in the key already
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DepsKeyError(f"{where}: {what} file {path} does not exist") from None
    except OSError as exc:
        raise DepsKeyError(f"{where}: cannot read {what} file {path}: {exc.strerror}") from None
    c.seen_files.add(path)
    c.add(f"{what}:{path}", "sha256:" + hashlib.sha256(data).hexdigest())
    text = data.decode("utf-8", errors="replace")
    for variable in sorted(set(_ENV_REFERENCE.findall(text))):
        c.add(f"env:{variable}", strip_credentials(c.env.get(variable, "")) + " (referenced in a requirement file)")
    for number, line in _requirement_lines(text):
        line = _ENV_REFERENCE.sub(lambda m: c.env.get(m.group(1), m.group(0)), line)
        here = f"{path}:{number}"
        if not line.startswith("-"):
            _local_requirement(c, line.split(";")[0].split(" @ ")[-1].strip(), path.parent)
            continue
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise DepsKeyError(f"{here}: {exc}") from None
        for option, value in _options(words, _PIP_VALUE_OPTIONS | _UV_VALUE_OPTIONS):
            _option(c, option, value, depth + 1, here, path.parent)


def _local_requirement(c: _Collector, text: str, base: Path) -> None:
    text = text.removeprefix("file://") if text.startswith("file://") else text
    if not text or not _looks_like_path(text):
        return
    for candidate in (c.resolve(text), c.resolve(text, base)):
        if os.path.lexists(candidate):
            c.add(f"local:{candidate}", _tree(candidate, skip=(".git", "build", ".venv")))
            return


def _option(c: _Collector, option: str, value: str | None, depth: int, where: str, base: Path) -> None:
    """One option of the command line or of a requirement file (``base``: where relative paths start)."""
    if option in _REQUIREMENT_FLAGS and value is not None:
        _read_requirement_file(c, c.resolve(value, base) if not _URL.match(value) else Path(value),
                               _REQUIREMENT_FLAGS[option], depth, where)  # fmt: skip
    elif option in _INDEX_FLAGS and value is not None:
        c.add(_INDEX_FLAGS[option], strip_credentials(value))
    elif option in _FIND_LINKS_FLAGS and value is not None:
        if _URL.match(value) and not value.startswith("file://"):
            c.add("find-links", strip_credentials(value))
        else:
            path = c.resolve(value.removeprefix("file://"), base)
            c.add(f"find-links:{path}", find_links_digest(path))
    elif option in ("-e", "--editable") and value is not None:
        _local_requirement(c, value, base)
    elif option == "--no-index":
        c.add("no-index", "yes")


# -- configuration files ------------------------------------------------------------------------


def _config_files(kind: str, env: Mapping[str, str], cwd: Path, python_prefix: str) -> list[Path]:
    home = Path(env.get("HOME", os.path.expanduser("~")))
    xdg_config = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
    xdg_dirs = [Path(p) for p in (env.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(":") if p]
    if kind == "pip":
        if env.get("PIP_CONFIG_FILE") == os.devnull:
            return []
        files = [d / "pip" / "pip.conf" for d in xdg_dirs] + [Path("/etc/pip.conf"), home / ".pip" / "pip.conf",
                                                               xdg_config / "pip" / "pip.conf"]  # fmt: skip
        if python_prefix:
            files.append(Path(python_prefix) / "pip.conf")
        if env.get("PIP_CONFIG_FILE"):
            files.append(Path(env["PIP_CONFIG_FILE"]))
        return files
    if env.get("UV_NO_CONFIG"):
        return []
    if env.get("UV_CONFIG_FILE"):
        return [Path(env["UV_CONFIG_FILE"])]
    files = [d / "uv" / "uv.toml" for d in xdg_dirs] + [Path("/etc/uv/uv.toml"), xdg_config / "uv" / "uv.toml"]
    for directory in [cwd, *cwd.parents]:  # the nearest project configuration, as uv finds it
        project = [directory / "uv.toml", directory / "pyproject.toml"]
        if any(p.exists() for p in project):
            files += project
            break
    return files


#: Settings (pip.conf keys, ``PIP_*``/``UV_*`` variables) that name files or directories whose contents count.
_FILE_SETTINGS = {"constraint": "-c", "constraints": "-c", "requirement": "-r", "find-links": "-f",
                  "PIP_CONSTRAINT": "-c", "PIP_REQUIREMENT": "-r", "PIP_FIND_LINKS": "-f",
                  "UV_CONSTRAINT": "-c", "UV_OVERRIDE": "--overrides", "UV_FIND_LINKS": "-f",
                  "UV_BUILD_CONSTRAINT": "-c"}  # fmt: skip


def _pip_config(c: _Collector, path: Path) -> None:
    """Follow what a pip.conf's [global]/[install] sections name: constraint and requirement files, find-links."""
    import configparser

    parser = configparser.RawConfigParser()
    try:
        parser.read(path)
    except configparser.Error as exc:
        raise DepsKeyError(f"{path}: unreadable pip configuration: {exc}") from None
    for section in ("global", "install"):
        if not parser.has_section(section):
            continue
        for name, value in parser.items(section):
            flag = _FILE_SETTINGS.get(name)
            if flag:
                for word in value.split():
                    _option(c, flag, word, 1, f"{path} [{section}] {name}", path.parent)


def _environment(c: _Collector, kind: str) -> None:
    for name in sorted(c.env):
        flag = _FILE_SETTINGS.get(name)
        if flag and name.startswith("PIP_" if kind == "pip" else "UV_"):
            for word in re.split(r"[\s,]+", c.env[name].strip()):
                if word:
                    _option(c, flag, word, 1, f"${name}", c.cwd)
        value = c.env[name]
        if name.startswith("PIP_") and kind == "pip" and name not in PIP_IGNORED:
            c.add(f"env:{name}", strip_credentials(value))
        elif name.startswith("UV_") and kind.startswith("uv") and name not in UV_IGNORED and not _UV_CREDENTIAL.match(name):
            c.add(f"env:{name}", strip_credentials(value))
        elif name in PYTHON_VARS or name in OTHER_VARS:
            c.add(f"env:{name}", value)


# -- the key ----------------------------------------------------------------------------------


@traced("deps.key", phase="dependencies", attrs=lambda key: {"key": key.key, "inputs": len(key.inputs)})  # start-up profiler
def compute_key(
    argv: Sequence[str],
    *,
    prefix: str | os.PathLike[str] | None = None,
    base_chain: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    python: str | None = None,
    prior_content: str | None = None,
    extra_files: Sequence[str] = (),
    scope: str = "",
) -> DepsKey:
    """The key of installing with ``argv`` into ``prefix`` (bare metal) or onto ``base_chain`` (a container).

    Exactly one of ``prefix`` and ``base_chain``.  ``prior_content``: the prefix's
    content digest to use instead of hashing it now (a prefix bootseer already
    installed into remembers what it held before).  ``extra_files``: more files the
    command reads (for commands other than pip and uv).  ``scope`` (bare metal:
    ``--scope``): a name that keeps this install's snapshots apart from others' (a
    team, a project); in a container the snapshotter scopes the key itself
    (:func:`container_store_key`), so a scope here is refused.
    """
    if not argv:
        raise DepsKeyError("no install command given")
    if (prefix is None) == (base_chain is None):
        raise DepsKeyError("a key is computed for a prefix (bare metal) or a base ChainID (a container), exactly one")
    if env is None:
        # In a container the install sees the container's environment and configuration files, not
        # this process's: there only what the caller passes counts (``bootseer deps key --env``).
        env = dict(os.environ) if prefix is not None else {}
    env = dict(env)
    if scope and base_chain is not None:
        raise DepsKeyError("a container's key is scoped by the snapshotter (its [depsnap] scope and the containerd "
                        "namespace), not here")  # fmt: skip
    c = _Collector(cwd=Path(cwd or os.getcwd()).absolute(), env=env)
    c.add("format", str(KEY_VERSION))
    if scope:
        c.add("scope", check_scope(scope))
    kind, args, _ = _tool(argv, env)
    interpreter = ""
    python_prefix = ""
    if prefix is not None:
        prefix_path = Path(prefix).absolute()
        c.add("mode", "prefix")
        c.add("prefix", str(prefix_path))
        content = prior_content or _tree(prefix_path)
        # A missing prefix and an empty one install alike (and a restore leaves an empty mount point).
        c.add("prefix-content", "empty" if content == "absent" else content)
        interpreter = python or find_interpreter(argv, env, prefix_path)
        facts = probe_interpreter(interpreter)
        python_prefix = facts["prefix"]
        c.add("python", facts["executable"])
        for name in ("version", "implementation", "cache_tag", "abi", "abiflags", "platform", "machine", "libc"):
            c.add(f"python.{name}", facts[name])
        if kind == "pip":
            c.add("pip.version", facts["pip"] or "none")
    else:
        c.add("mode", "container")
        c.add("base", str(base_chain))
    c.add("command", json.dumps(list(argv)))
    if kind.startswith("uv"):
        c.add("uv.version", _uv_version(env, argv[0]) if prefix is not None else "in the image")
    value_options = _UV_VALUE_OPTIONS if kind.startswith("uv") else _PIP_VALUE_OPTIONS
    if kind in ("pip", "uv-pip-install", "uv-pip-sync"):
        for option, value in _options(args, value_options):
            if option == "" and value is not None:
                if kind == "uv-pip-sync":
                    _read_requirement_file(c, c.resolve(value), "requirements", 1, "command line")
                else:
                    _local_requirement(c, value, c.cwd)
            else:
                _option(c, option, value, 1, "command line", c.cwd)
    elif kind == "uv-sync":
        project = c.cwd
        for option, value in _options(args, value_options):
            if option in ("--project", "--directory") and value:
                project = c.resolve(value)
        for name in ("pyproject.toml", "uv.lock"):
            path = project / name
            if not path.exists():
                if name == "pyproject.toml":
                    raise DepsKeyError(f"uv sync: {path} does not exist")
                continue
            c.add(f"lock:{path}", file_digest(path))
    for extra in extra_files:
        path = c.resolve(extra)
        if not path.exists():
            raise DepsKeyError(f"input file {path} does not exist")
        c.add(f"input:{path}", _tree(path))
    if kind != "other" and prefix is not None:  # a container's configuration files are in its image (the base)
        for path in _config_files("pip" if kind == "pip" else "uv", env, c.cwd, python_prefix):
            if path.is_file():
                c.add(f"config:{path}", file_digest(path))
                if kind == "pip":
                    _pip_config(c, path)
    _environment(c, kind)
    canonical = json.dumps(sorted(c.inputs.items()), separators=(",", ":"), ensure_ascii=True)
    return DepsKey(key=hashlib.sha256(canonical.encode()).hexdigest(), inputs=c.inputs, python=interpreter)


def check_scope(text: str) -> str:
    """``text`` as a scope (1-128 of letters, digits and ``._:/@+-``, starting with a letter or digit), else DepsKeyError."""
    if not _SCOPE.fullmatch(text):
        raise DepsKeyError(f"not a scope (1-128 letters, digits and ._:/@+-, starting with a letter or digit): {text!r}")
    return text


def container_store_key(request_key: str, *, namespace: str, scope: str = "") -> str:
    """The name (``v1/deps/<name>.json``) of a container's snapshot: its label's key scoped to where it was prepared.

    The label's key (``bootseer deps key --base``) is chosen by whoever starts the
    container; the containerd namespace the snapshot is prepared in (sent by containerd
    with every request) and the snapshotter's configured scope are not.  So a snapshot
    captured in namespace A (or under scope S) is found only by containers of namespace
    A (under S): the same label in namespace B names another record, a miss.
    """
    canonical = json.dumps([["format", str(KEY_VERSION)], ["key", check_key(request_key)], ["mode", "container"],
                            ["namespace", namespace], ["scope", scope]], separators=(",", ":"), ensure_ascii=True)  # fmt: skip
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_key(text: str) -> str:
    """``text`` as a key (64 lowercase hex digits; a ``sha256:`` prefix is accepted), else DepsKeyError."""
    key = text.removeprefix("sha256:")
    if not re.fullmatch(r"[0-9a-f]{64}", key):
        raise DepsKeyError(f"not a dependency snapshot key (64 hex digits): {text!r}")
    return key
