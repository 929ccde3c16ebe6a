"""SyncBatchNorm that also runs on CPU ranks (gloo).

torch.nn.SyncBatchNorm only accepts CUDA-like inputs, and DDP refuses it in
CPU modules, so CPU runs (CI, the demo, the gradient-parity test) get this
version: each channel's sum, sum of squares and count are all-reduced once per
layer with torch.distributed.nn's differentiable all_reduce, which also makes
the backward pass sum the statistics' gradients across ranks. On CUDA the
trainer keeps torch's fused implementation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce


class CpuSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics are those of the global batch across all ranks."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x.float()
        count = torch.full((1,), x.numel() // channels, dtype=torch.float64, device=x.device)
        local = torch.cat([xf.sum(dims).double(), (xf * xf).sum(dims).double(), count])
        total = all_reduce(local)
        n = total[2 * channels]
        mean = total[:channels] / n
        var = (total[channels : 2 * channels] / n - mean * mean).clamp(min=0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = self.momentum if self.momentum is not None else 1.0 / self.num_batches_tracked.item()
                self.running_mean.mul_(1 - factor).add_(mean.float(), alpha=factor)
                self.running_var.mul_(1 - factor).add_((var * n / (n - 1).clamp(min=1)).float(), alpha=factor)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (xf - mean.float().view(shape)) * torch.rsqrt(var.float().view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert(module: nn.Module, device_type: str) -> nn.Module:
    """Swap every BatchNorm for its synchronised form: torch's on CUDA, CpuSyncBatchNorm elsewhere."""
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, CpuSyncBatchNorm):
        out = CpuSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                out.weight.copy_(module.weight)
                out.bias.copy_(module.bias)
        if module.track_running_stats:
            out.running_mean.copy_(module.running_mean)
            out.running_var.copy_(module.running_var)
            out.num_batches_tracked.copy_(module.num_batches_tracked)
        out.train(module.training)
        out.to(module.running_mean.device if module.running_mean is not None else "cpu")
    for name, child in module.named_children():
        out.add_module(name, convert(child, device_type))
    return out
