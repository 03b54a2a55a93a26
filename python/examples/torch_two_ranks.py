#!/usr/bin/env python3
"""ep with torch: ranks as processes joined by torch.distributed (gloo), one
normal-mode and one low-latency dispatch/combine each, identity experts.

    python3 python/examples/torch_two_ranks.py             # 2 ranks, host backend, CPU tensors
    python3 python/examples/torch_two_ranks.py --gpu       # GPU backend, one GPU per rank
    python3 python/examples/torch_two_ranks.py --ranks 4

With identity experts, combine gives back each token times the sum of its
routing weights; the example checks that and prints one line per rank.
"""
import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ep


def rank_main(rank: int, world: int, gpu: bool, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if gpu:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    config = ep.Config(hidden=1024, topk=4, num_experts=4 * world, max_tokens_per_rank=256,
                       ll_max_tokens_per_rank=64, backend="gpu" if gpu else "host")
    with ep.from_process_group(config) as ctx:  # the unique id goes over the group
        torch.manual_seed(rank)
        n = 100 + 10 * rank
        x = torch.randn(n, ctx.hidden).to(torch.bfloat16).to(device)
        # DeepEP-style int64 expert ids (int32 avoids a copy); -1 would drop a slot.
        topk_idx = torch.rand(n, ctx.num_experts).argsort(dim=1)[:, :ctx.topk].contiguous().to(device)
        topk_weights = torch.rand(n, ctx.topk).to(device)
        want = x.float() * topk_weights.sum(dim=1, keepdim=True)

        # Normal mode: expert-major rows, each local expert's segment aligned
        # to 8 rows, ready for a grouped GEMM (here: identity experts).
        d = ctx.dispatch(x, topk_idx, topk_weights, source_order=False, expert_major=True,
                         expert_alignment=8)
        expert_outputs = d.expert_x  # a model runs its experts on these rows
        out = ctx.combine(expert_outputs, d)  # weighted and summed per token
        normal_error = relative_error(out, want)

        # Low-latency mode: FP8 on the wire, weights applied on the expert side.
        m = 32
        ll = ctx.ll_dispatch(x[:m], topk_idx[:m], topk_weights[:m])
        scales = ll.recv_x_scales.repeat_interleave(128, dim=-1)
        expert_outputs = (ll.recv_x.float() * scales).to(torch.bfloat16)
        out = ctx.ll_combine(expert_outputs, ll)
        ll_error = relative_error(out, want[:m])

        ok = normal_error < 1 / 64 and ll_error < 1 / 8
        print(f"rank {rank}/{world} ({ctx.backend}): {n} tokens, {d.num_expert_rows} expert "
              f"rows received; combine error {normal_error:.2g} (normal), {ll_error:.2g} "
              f"(low-latency, FP8): {'ok' if ok else 'FAILED'}", flush=True)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().clamp(min=1e-6)
    return float((got.float().cpu() - want.cpu()).abs().max() / scale.cpu())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="GPU backend, one GPU per rank")
    args = parser.parse_args()
    mp.spawn(rank_main, args=(args.ranks, args.gpu, free_port()), nprocs=args.ranks)
    print(f"torch_two_ranks.py: all {args.ranks} ranks passed")


if __name__ == "__main__":
    main()
