"""The trainer's code path (dtjob.trainer, dtjob.launcher, dtjob.contract) imports neither pydantic
nor kopf (#41): the trainer image and the GPU machine have neither, only torch and the trainer's
extra. Every module is imported in a fresh process whose import system refuses both."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.trainer.runtime_gang import REPO

# An import hook that fails any import of pydantic or kopf, then every module of the code path
# (the __main__ modules run their program when imported: their imports are modules listed here).
_CHECK = """
import importlib, json, pkgutil, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pydantic", "kopf"):
            raise ImportError(f"the trainer's code path imported {name}")
        return None

for name in [m for m in sys.modules if m.split(".")[0] in ("pydantic", "kopf")]:
    del sys.modules[name]
sys.meta_path.insert(0, Refuse())
import dtjob.contract, dtjob.launcher, dtjob.trainer
names, failed = ["dtjob.contract"], {}
for package in (dtjob.trainer, dtjob.launcher):
    names.append(package.__name__)
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.rsplit(".", 1)[-1] != "__main__":
            names.append(info.name)
for name in names:
    try:
        importlib.import_module(name)
    except Exception as err:
        failed[name] = repr(err)
print(json.dumps({"imported": names, "failed": failed}))
"""


def test_the_trainers_code_path_imports_neither_pydantic_nor_kopf() -> None:
    path = os.pathsep.join(str(REPO / d) for d in ("operator", "trainer_image", "devcluster"))
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", _CHECK], capture_output=True, text=True, check=True, env=env, cwd=REPO
    ).stdout
    result = json.loads(out.splitlines()[-1])
    assert result["failed"] == {}
    # The walk found the code path (a test that imported nothing would pass too).
    assert {"dtjob.trainer.loop", "dtjob.trainer.session", "dtjob.launcher.agent"} <= set(result["imported"])
