"""The installed distribution: a wheel built from this checkout carries the packaged configs,
``py.typed`` and the version, and its entry points run from outside the checkout."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import flashrt_gym
from flashrt_gym import cli

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "runtime", "kernels", "policies", "flashrt_gym", "configs")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel of this checkout (built from a copy, so the checkout gains no build/ folder),
    installed with --no-deps into a folder of its own; returns that folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    (wheel,) = (tmp / "dist").glob("flashrt_gym-*.whl")
    target = tmp / "site"
    install = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-4000:]
    return target


def run_installed(target: Path, *cmd: str) -> subprocess.CompletedProcess:
    """``cmd`` run from a folder outside the checkout, importing the installed copy first."""
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    cwd = target.parent / "elsewhere"
    cwd.mkdir(exist_ok=True)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def test_wheel_holds_configs_types_and_version(installed):
    (wheel,) = installed.parent.glob("dist/flashrt_gym-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*.yaml")}
    assert configs and {f"flashrt_gym/{c}" for c in configs} <= names  # every config, from the one source
    assert "flashrt_gym/py.typed" in names
    shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / "flashrt_gym" / "assets").rglob("*") if p.is_file()}
    data = {a for a in shipped if a.endswith((".json", ".safetensors", ".xml"))}  # the policies and the scene
    assert {f"flashrt_gym/assets/{d}/model.safetensors" for d in ("tiny", "tiny_mujoco", "tiny_metaworld")} <= data
    assert data <= names
    assert wheel.name.startswith(f"flashrt_gym-{flashrt_gym.__version__}-")
    out = run_installed(
        installed,
        sys.executable,
        "-c",
        "import flashrt_gym, importlib.metadata as m; "
        "print(flashrt_gym.__file__, flashrt_gym.__version__, m.version('flashrt-gym'))",
    )
    where, version, dist = out.stdout.split()
    assert Path(where).is_relative_to(installed), where  # the wheel's copy, not the checkout's
    assert version == dist == flashrt_gym.__version__ == importlib.metadata.version("flashrt-gym")


@pytest.mark.parametrize(
    "cmd",
    [
        ("bin/flashrt-train", "--cfg", "job", "experiment=quick"),
        ("bin/flashrt-eval", "--cfg", "job", "+split=test"),
        ("-m", "flashrt_gym", "train", "--cfg", "job", "agent=sac"),
    ],
)
def test_entry_points_compose_the_packaged_configs(installed, cmd):
    """The console scripts and ``python -m flashrt_gym`` find the configs inside the wheel."""
    prog = (sys.executable, *cmd) if cmd[0] == "-m" else (sys.executable, str(installed / cmd[0]), *cmd[1:])
    out = run_installed(installed, *prog).stdout
    assert "seed: 0" in out and "num_envs:" in out
    assert ("split: test" in out) == ("+split=test" in cmd)
    assert ("_target_: flashrt_gym.learners.graph_sac.GraphSAC" in out) == ("agent=sac" in cmd)


def test_train_help_from_the_wheel(installed):
    out = run_installed(installed, sys.executable, str(installed / "bin/flashrt-train"), "--help").stdout
    assert "train is powered by Hydra" in out and "experiment: dsrl_sac, metaworld_mt10, quick, smoke" in out


def test_module_usage(capsys):
    with pytest.raises(SystemExit) as ok:
        cli.main(["--help"])
    assert ok.value.code == 0 and "{train,eval}" in capsys.readouterr().out
    for argv, says in (([], "no job named"), (["fit"], "unknown job 'fit'")):
        with pytest.raises(SystemExit) as bad:
            cli.main(argv)
        assert bad.value.code == 2 and says in capsys.readouterr().err
