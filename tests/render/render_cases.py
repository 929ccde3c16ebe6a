"""Job specs the render tests share: 1, 2 and 64 replicas, CPU and GPU, queue, volumes, secrets."""

from __future__ import annotations

from pathlib import Path

from ddpk.spec import JobSpec

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO.parent / "shared" / "schemas"
K8S_TARGETS = ("indexedjob", "pytorchjob", "jobset")

CASES = {
    "one-cpu": JobSpec(name="solo", replicas=1),
    "two-cpu": JobSpec(
        name="ddpk-demo",
        replicas=2,
        nproc_per_node="2",
        cpu_request="1",
        cpu_limit="2",
        memory_request="2Gi",
        memory_limit="4Gi",
        trainer_args=["--epochs", "2", "--model", "convnet"],
    ),
    "two-gpu-queue": JobSpec(
        name="gpu-job",
        namespace="team-a",
        replicas=2,
        gpus_per_replica=8,
        queue="team-a-queue",
        priority_class="training-high",
        node_selector={"nvidia.com/gpu.product": "H100-SXM"},
        tolerations=["nvidia.com/gpu:NoSchedule", "dedicated=training:NoExecute"],
        active_deadline_s=86400,
        ttl_after_finished_s=None,
    ),
    "wide-volumes-secrets": JobSpec(
        name="wide",
        replicas=64,
        nproc_per_node="4",
        gpus_per_replica=4,
        image="registry.example.com/ml/ddpk:1.2.3",
        image_pull_policy="Always",
        data_pvc="imagenet",
        checkpoint_pvc="wide-checkpoints",
        env={"NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5"},
        env_from_secrets=["wandb-api", "hf-token"],
        service_account="trainer",
        max_restarts=5,
        port=23456,
        rdzv_timeout_s=900,
        trainer_args=["--dataset", "imagefolder", "--epochs", "90"],
    ),
}
