"""Runs scripts for ``e2e/test_benchmark_scripts.py`` without each paying the imports.

A script's smoke run in a fresh ``python`` spends several seconds importing torch, transformers,
PEFT, Triton and peft_fastlora before it does anything. This process imports them once, then for
each request (a JSON line on stdin: ``argv``, ``env``, ``cwd``, ``out``) forks a child that runs the
script as ``__main__`` with its output in the file ``out``: the child starts from this process's
state, imports done and nothing else run, so scripts cannot see each other. It answers a line with
the child's pid at once and a line with its exit status when it ends.

    python tests/_script_runner.py   # started by the test module, one per test process
"""

import json
import os
import runpy
import sys
import traceback


def _child(req):
    fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(req["cwd"])
    os.environ.update(req["env"])
    script = req["argv"][0]
    sys.argv = list(req["argv"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as ``python script.py`` has it
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: B036 (the script's failure, reported as its exit status)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main():
    import torch
    import transformers  # noqa: F401
    import peft  # noqa: F401
    import triton  # noqa: F401

    import peft_fastlora  # noqa: F401

    torch.set_num_threads(1)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
