"""Child process of the hostile-file suite: ``localmoe info`` on each file given, in one
process (opening a file is pure Python), printing one JSON line per file:
``{"path", "rc", "err", "tb"}`` (``tb``: an exception escaped the command)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback


def main(paths: list[str]) -> None:
    from localmoe.cli import cli

    for p in paths:
        out, err = io.StringIO(), io.StringIO()
        tb = None
        rc = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(args=["info", p], prog_name="localmoe")
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - reported, this is the point
                tb = traceback.format_exc()
                rc = 99
        print(json.dumps({"path": p, "rc": rc, "err": err.getvalue(), "tb": tb}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
