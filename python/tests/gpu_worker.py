"""One rank of a GPU test case: ``python gpu_worker.py CASE`` with the launcher's variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) set by
`test_gpu.py`. Joins a gloo process group (which also works with two ranks on one GPU), picks
GPU ``LOCAL_RANK % device_count`` and runs case CASE of ``gpu_cases.CASES`` or
``gpu_cases_deep_ep.CASES``; exits non-zero with the traceback on stderr when the case fails."""

import os
import sys
import traceback

import torch
import torch.distributed as dist


def main(case):
    import gpu_cases

    cases = gpu_cases.CASES
    if case not in cases:
        import gpu_cases_deep_ep

        cases = gpu_cases_deep_ep.CASES

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cases[case](gpu_cases.Ctx())
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
