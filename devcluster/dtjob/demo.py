"""`make demo` (python -m dtjob.demo): the main job on the local cluster, end to end.

1. brings the devcluster up unless one is running,
2. installs the DistributedTrainingJob CRD,
3. starts the operator (in the background; it keeps running after the demo so you can play),
4. applies examples/fsdp-gpt.yaml (FSDP ZeRO-3, built-in GPT, 4 workers, elastic 2..4),
5. shows its progress until it succeeds, then prints commands to try a node failure and a rescale.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from dtjob.devcluster.binaries import Binaries
from dtjob.devcluster.layout import Layout

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "training.dtjob.io_distributedtrainingjobs.yaml"
EXAMPLE = REPO / "examples" / "fsdp-gpt.yaml"
# 200 steps of a 2-layer GPT on 4 CPU workers sharing 2 cores take a few minutes; more than this
# means something is stuck.
JOB_TIMEOUT_SECONDS = 30 * 60
POLL_SECONDS = 2.0


def _run(argv: list[str], check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    if check and result.returncode != 0:
        raise SystemExit(
            f"demo: {' '.join(argv[:3])} ... failed: {result.stderr.strip() or result.stdout.strip()}"
        )
    return result


class Demo:
    def __init__(self) -> None:
        self.layout = Layout.from_env()
        self.kubectl_path = str(Binaries.pinned().path("kubectl"))
        self.dtjob = [sys.executable, "-m", "dtjob.cli"]

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([self.kubectl_path, *args], check=check)

    def cluster_up(self) -> None:
        # `up` on a running cluster changes nothing, but refuses one whose pods would run another
        # checkout's code.
        status = _run([*self.dtjob, "devcluster", "status"], check=False)
        if status.returncode != 0:
            print(
                "devcluster: starting (etcd, kube-apiserver, controller-manager, scheduler, 3 nodelets) ..."
            )
        up = subprocess.run([*self.dtjob, "devcluster", "up"], check=False)
        if up.returncode != 0:
            raise SystemExit("demo: `dtjob devcluster up` failed (see its output above)")
        os.environ["KUBECONFIG"] = str(self.layout.admin_kubeconfig)

    def install_crd(self) -> None:
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
        # Polled: `kubectl wait --for=condition=Established` fails at once while a just-created
        # CRD has no status yet.
        established = '{.status.conditions[?(@.type=="Established")].status}'
        name = self.kubectl("get", "-f", str(CRD), "-o", "jsonpath={.metadata.name}").stdout.strip()
        deadline = time.monotonic() + 60
        while self.kubectl("get", f"crd/{name}", "-o", f"jsonpath={established}").stdout != "True":
            if time.monotonic() > deadline:
                raise SystemExit(f"demo: CRD {name} not Established after 60 s")
            time.sleep(0.5)
        print(f"CRD: {CRD.name} installed")

    def start_operator(self, namespace: str) -> Path:
        log = self.layout.root / "logs" / "demo-operator.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        pid_file = self.layout.root / "demo-operator.pid"
        if pid_file.exists() and Path(f"/proc/{pid_file.read_text().strip()}").exists():
            print(f"operator: already running (pid {pid_file.read_text().strip()}, log {log})")
            return log
        with log.open("ab") as out:
            proc = subprocess.Popen(
                # only the demo's namespace: other jobs on a shared cluster are not the demo's
                [
                    *self.dtjob,
                    "operator",
                    "--namespace",
                    namespace,
                    "--liveness",
                    "http://127.0.0.1:8089/healthz",
                    "--metrics-port",
                    "9409",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # keeps running after the demo: try the commands it prints
            )
        pid_file.write_text(str(proc.pid))
        print(f"operator: started (pid {proc.pid}, log {log})")
        return log

    def apply_job(self) -> tuple[str, str]:
        manifest = yaml.safe_load(EXAMPLE.read_text())
        name = manifest["metadata"]["name"]
        namespace = manifest["metadata"].get("namespace", "default")
        if self.kubectl("get", "dtj", name, "-n", namespace, check=False).returncode == 0:
            print(f"job: deleting the previous {name}")
            self.kubectl("delete", "dtj", name, "-n", namespace, "--wait=true", "--timeout=120s")
        # A fresh run: the previous run's checkpoints would make it resume at its last step.
        host_path = ((manifest["spec"].get("checkpoint") or {}).get("volume") or {}).get("hostPath", {})
        if host_path.get("path", "").startswith("/tmp/dtjob-checkpoints/"):
            shutil.rmtree(host_path["path"], ignore_errors=True)
        self.kubectl("apply", "-f", str(EXAMPLE))
        print(f"job: applied {EXAMPLE.relative_to(REPO)}")
        return namespace, name

    def follow(self, namespace: str, name: str) -> str:
        deadline = time.monotonic() + JOB_TIMEOUT_SECONDS
        last = ""
        while time.monotonic() < deadline:
            got = self.kubectl("get", "dtj", name, "-n", namespace, "-o", "json", check=False)
            if got.returncode == 0:
                status = json.loads(got.stdout).get("status") or {}
                checkpoint = (status.get("lastCheckpoint") or {}).get("step", "-")
                line = (
                    f"phase={status.get('phase', '-'):<10} workers={status.get('readyReplicas', 0)}/"
                    f"{status.get('replicas', '-')} generation={status.get('generation', '-')} "
                    f"restarts={status.get('restarts', 0)} step={status.get('step', '-')} "
                    f"checkpoint={checkpoint}"
                )
                if line != last:
                    print(f"{time.strftime('%H:%M:%S')}  {line}", flush=True)
                    last = line
                if status.get("phase") in {"Succeeded", "Failed"}:
                    return str(status["phase"])
            time.sleep(POLL_SECONDS)
        return "Timeout"

    def last_loss(self, namespace: str, name: str) -> str:
        logs = self.kubectl("logs", f"{name}-worker-0", "-n", namespace, "--tail=200", check=False).stdout
        steps = [json.loads(line) for line in logs.splitlines() if line.startswith("{") and '"loss"' in line]
        if len(steps) < 2:
            return ""
        first, last = steps[0], steps[-1]
        return (
            f"loss {first['loss']:.3f} at step {first['step']} -> {last['loss']:.3f} at step {last['step']}"
        )


def main(argv: list[str] | None = None) -> int:
    demo = Demo()
    demo.cluster_up()
    demo.install_crd()
    manifest = yaml.safe_load(EXAMPLE.read_text())
    operator_log = demo.start_operator(manifest["metadata"].get("namespace", "default"))
    namespace, name = demo.apply_job()
    phase = demo.follow(namespace, name)
    print()
    print(f"job {name}: {phase}. {demo.last_loss(namespace, name)}")
    print(demo.kubectl("get", "dtj", name, "-n", namespace, check=False).stdout)
    print(
        "Try it yourself (the operator keeps running; its log is " + str(operator_log) + "):\n"
        f"  export KUBECONFIG={demo.layout.admin_kubeconfig} PATH={Path(demo.kubectl_path).parent}:$PATH\n"
        f"  kubectl delete dtj {name}; rm -rf /tmp/dtjob-checkpoints/{name}; kubectl apply -f {EXAMPLE}\n"
        f"  kubectl get dtj {name} -w                      # in another terminal\n"
        f"  kubectl get pods -o wide -l training.dtjob.io/job-name={name}\n"
        "  # node failure: stop the node of a worker; the gang restarts at the size that fits\n"
        "  dtjob devcluster node stop dtjob-node-1\n"
        "  dtjob devcluster node start dtjob-node-1          # capacity returns: it grows back\n"
        "  # rescale, losing no step (SIGTERM -> checkpoint -> exit 75 -> new generation)\n"
        f"  kubectl scale dtj/{name} --replicas=2\n"
        f"  kubectl describe dtj {name}                    # events: every transition and why\n"
        f"  kill $(cat {demo.layout.root / 'demo-operator.pid'})                # stop the operator\n"
    )
    return 0 if phase == "Succeeded" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
