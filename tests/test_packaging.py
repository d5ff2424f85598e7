"""Packaging: the proto tree passes `buf lint`; the wheel installs one import package that works
outside the checkout; a command whose optional extra is missing says which one to install."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUF = ROOT / ".tools" / "node_modules" / ".bin" / "buf"


def test_protos_pass_buf_lint() -> None:
    if not BUF.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("buf comes from the npm registry (@bufbuild/buf) and npm is not installed")
        subprocess.run([npm, "install", "--silent", "--prefix", str(ROOT / ".tools"), "@bufbuild/buf"],
                       check=True, timeout=300)
    run = subprocess.run([str(BUF), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


# --- optional extras --------------------------------------------------------------------------


def run_without(module: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The CLI in a fresh interpreter where `module` cannot be imported (as if its extra were
    not installed)."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from specwire.client.cli import main\n"
        f"raise SystemExit(main({list(argv)!r}))"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("module", "argv", "extra"),
    [
        ("matplotlib", ["trace", "summarize", "spans.jsonl", "--plot", "rounds.png"], "plots"),
        ("matplotlib", ["experiment", "--rtt-ms", "0", "--out", "experiment"], "plots"),
        ("matplotlib", ["generate", "--address", "127.0.0.1:1", "--prompt", "x", "--strategy", "entropix",
                        "--plot", "states.png"], "plots"),
        ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
         ["serve", "orchestrator", "--target", "127.0.0.1:1", "--port", "0", "--trace-exporter", "otlp"], "otlp"),
    ],
    ids=["trace-plot", "experiment", "generate-plot", "otlp"],
)
def test_missing_extra_names_the_install_command(module: str, argv: list[str], extra: str, tmp_path: Path) -> None:
    run = run_without(module, argv, tmp_path)
    assert run.returncode != 0
    assert f"pip install 'specwire[{extra}]'" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "experiment").exists()  # refused before any work


# --- the wheel ------------------------------------------------------------------------------


def build_wheel(out: Path) -> Path:
    """The wheel of a copy of the checkout (so no stale build/ folder leaks into it)."""
    source = out / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".tools", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "out", "bench-out"
    ))
    import setuptools

    # setuptools ≥ 77 (dev extra) builds in place; an older one gets an isolated build environment.
    flags = ["--no-build-isolation"] if int(setuptools.__version__.split(".")[0]) >= 77 else []
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *flags, "-w", str(out), str(source)],
                           timeout=300, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = out.glob("specwire-*.whl")
    return wheel


def dependency_paths() -> list[str]:
    """Where this interpreter finds specwire's dependencies: its site-packages folders. Listed as
    plain paths in a .pth file, so the .pth files inside them (the editable install's finder of
    this checkout among them) are not run."""
    folders = [*site.getsitepackages(), site.getusersitepackages()]
    return [folder for folder in folders if Path(folder).is_dir()]


def test_wheel_holds_one_package_and_works_from_a_fresh_venv(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"specwire"}
    for needed in ["specwire/v1/orchestrator_pb2.py", "specwire/v1/orchestrator_pb2_grpc.py", "specwire/v1/model_pb2.py",
                   "specwire/v1/common_pb2.py", "specwire/v1/orchestrator.proto", "specwire/v1/model.proto",
                   "specwire/v1/common.proto", "specwire/client/sdk.py", "specwire/bench/bench.py",
                   "specwire/openai_http/server.py", "specwire/demo/pair/target/config.json", "specwire/demo/pair/draft/config.json",
                   "specwire/engine/w4a8.cpp", "specwire/engine/row_attention.cpp"]:
        assert needed in names, f"{needed} is not in the wheel"
    assert any(n.startswith("specwire/demo/pair/target/") and n.endswith(".safetensors") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
        timeout=300, capture_output=True, text=True,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    (site_packages,) = venv.glob("lib/python*/site-packages")
    (site_packages / "dependencies.pth").write_text("\n".join(dependency_paths()) + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    version = subprocess.run([str(venv / "bin" / "specwire"), "--version"], cwd=elsewhere, env=env,
                             capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("specwire "), version.stderr
    code = ("from specwire.client import AsyncClient, Client\n"
            "import specwire, specwire.v1.orchestrator_pb2 as pb, specwire.openai_http.server as front\n"
            "print(specwire.__file__); print(pb.__file__); print(front.__file__)")
    imported = subprocess.run([str(python), "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    for path in imported.stdout.split():
        assert Path(path).is_relative_to(venv), f"imported {path}, not the installed wheel"


def test_every_field_and_enum_value_of_the_protos_is_commented(tmp_path: Path) -> None:
    from google.protobuf import descriptor_pb2

    out = tmp_path / "protos.pb"
    protos = sorted(p.relative_to(ROOT / "protos").as_posix() for p in (ROOT / "protos").rglob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--include_source_info",
                    f"--descriptor_set_out={out}", *protos], cwd=ROOT / "protos", check=True)
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    uncommented = []
    for proto in files:
        commented = {tuple(loc.path) for loc in proto.source_code_info.location
                     if loc.leading_comments.strip() or loc.trailing_comments.strip()}
        for m, message in enumerate(proto.message_type):
            for f, field in enumerate(message.field):  # path: message_type=4, field=2
                if (4, m, 2, f) not in commented:
                    uncommented.append(f"{proto.name}: {message.name}.{field.name}")
        for e, enum in enumerate(proto.enum_type):
            for v, value in enumerate(enum.value):  # path: enum_type=5, value=2
                if (5, e, 2, v) not in commented:
                    uncommented.append(f"{proto.name}: {enum.name}.{value.name}")
    assert len(files) == 3 and not uncommented, uncommented
