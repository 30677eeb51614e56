"""Write (and optionally submit) a Slurm or PBS job script that runs a deck on a machine.

    python launch/submit.py DECK --machine M --nodes N [--time HH:MM:SS] [--account A]
        [--partition P] [--qos Q] [--constraint C] [--queue Q] [--filesystems F]
        [--job-name NAME] [--out PATH] [--set section.key=value ...] [--submit] [--force]

    python launch/submit.py inputs/gpt_tiny.yaml --machine frontier --nodes 4 --account abc123
    python -m launch.submit inputs/gpt_tiny.yaml --machine local --nodes 1 --submit

The machine (inputs/machines/M.yaml) gives the node shape, the launch line and the template
(launch/jobs/<template>); the world size is nodes x devices_per_node, and the deck is checked
against it before anything is written, so a deck that cannot run is refused here, not after
hours in the queue. The script holds absolute paths (repository, deck, working directory = the
directory submit.py ran in), so it runs from anywhere. Templates use `{{name}}` placeholders;
an unknown or unfilled one is an error. A user mistake prints one line `submit: ...` and exits
with status 2.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python launch/submit.py` puts launch/, not the repository, on sys.path
    sys.path.insert(0, str(REPO))

from app.deck import Deck, load_deck, resolve_for_world  # noqa: E402
from app.errors import GridlmError  # noqa: E402
from app.plan.dryrun import Plan, checkpoint_time, make_plan  # noqa: E402
from app.plan.estimate import checkpoint_bytes  # noqa: E402
from app.plan.machine import MACHINES_DIR, Machine, load_machine, machine_names, machine_path  # noqa: E402

JOBS_DIR = REPO / "launch" / "jobs"
# SIGUSR1 at least this long before the time limit (rendered into the templates as {{signal_lead_s}});
# longer where the dry run predicts a step and a checkpoint that need more (`signal_lead`).
SIGNAL_LEAD_S = 120
PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
# Values that go into #SBATCH/#PBS lines: no spaces, quotes or shell syntax that could end the line.
DIRECTIVE_VALUE = re.compile(r"^[^\s'\"`\\$;]+$")
JOB_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.+-]*$")
# option -> (schedulers that have it, directive format)
SCHEDULER_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "account": (("slurm", "pbs"), {"slurm": "#SBATCH --account={}", "pbs": "#PBS -A {}"}),
    "partition": (("slurm",), {"slurm": "#SBATCH --partition={}"}),
    "qos": (("slurm",), {"slurm": "#SBATCH --qos={}"}),
    "constraint": (("slurm",), {"slurm": "#SBATCH --constraint={}"}),
    "queue": (("pbs",), {"pbs": "#PBS -q {}"}),
    "filesystems": (("pbs",), {"pbs": "#PBS -l filesystems={}"}),
}
DEFAULT_KEYS = ("time", *SCHEDULER_OPTIONS)
SUBMIT_COMMAND = {"slurm": ["sbatch", "--parsable"], "pbs": ["qsub"]}


class SubmitError(GridlmError):
    """A submit.py option, template or submission is wrong; the message says which and the fix."""


def check_plan(deck: Deck, world_size: int, machine: Machine) -> list[str]:
    """The dry run's problems on `machine` (does not fit in device memory, a tp group spans
    nodes, unbalanced stages), one sentence each with its fix; empty when the plan is sound.
    A non-empty list stops submit.py unless --force."""
    return make_plan(deck, world_size, machine).problems


def signal_lead(plan: Plan) -> int:
    """Seconds before the time limit that SIGUSR1 comes: SIGNAL_LEAD_S, or more where the dry run
    predicts it: the ranks finish the step the signal falls in, then write a checkpoint, so the
    lead holds a step, twice the checkpoint's least time (its bytes at the file system's rate) and
    a minute. (A fixed 120 s was shorter than gpt_1t's predicted 195 s step on Frontier: the time
    limit's kill came before the checkpoint.)"""
    step = plan.predicted.step_time_s if plan.predicted is not None else 0.0
    save = checkpoint_time(plan).get("save_s") or 0.0
    return max(SIGNAL_LEAD_S, math.ceil(step + 2 * save + 60))


def parse_time(text: str, scheduler: str, lead: int = SIGNAL_LEAD_S, where: str = "--time") -> int:
    """Seconds in HH:MM:SS (any scheduler) or D-HH:MM:SS (Slurm); SubmitError otherwise, naming
    `where` the time came from (--time, or the machine file's defaults.time)."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):([0-5]\d):([0-5]\d)", text.strip())
    forms = "HH:MM:SS or D-HH:MM:SS" if scheduler == "slurm" else "HH:MM:SS (hours may exceed 24)"
    if not m:
        raise SubmitError(f"{where} {text!r}: expected {forms}, e.g. 02:00:00")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    if m.group(1) is not None:
        if scheduler != "slurm":
            raise SubmitError(f"{where} {text!r}: {scheduler} takes {forms}, e.g. {days * 24 + hours}:{m[3]}:{m[4]}")
        if hours > 23:
            raise SubmitError(f"{where} {text!r}: with days, hours must be 00-23")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= lead:
        raise SubmitError(f"{where} {text!r}: must be longer than {lead} s, the checkpoint warning before the limit")
    return total


def render(template: str, values: dict[str, Optional[str]], name: str = "template") -> str:
    """Fill `{{key}}` placeholders. A placeholder alone on its line whose value is empty removes the
    line; an unknown or unfilled (None) placeholder, or a malformed `{{`, is a SubmitError."""
    used = PLACEHOLDER.findall(template)
    if template.count("{{") != len(used) or template.count("}}") != len(used):
        raise SubmitError(f"{name}: a '{{{{' or '}}}}' that is not a {{{{name}}}} placeholder")
    unknown = sorted({k for k in used if k not in values})
    if unknown:
        raise SubmitError(f"{name}: unknown placeholder(s) {', '.join(unknown)}; known: {', '.join(sorted(values))}")
    unfilled = sorted({k for k in used if values[k] is None})
    if unfilled:
        raise SubmitError(f"{name}: no value for placeholder(s) {', '.join(unfilled)}")
    lines = []
    for line in template.splitlines(keepends=True):
        only = PLACEHOLDER.fullmatch(line.strip())
        if only and not values[only.group(1)]:
            continue
        lines.append(PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), line))
    return "".join(lines)


def scheduler_options(args: argparse.Namespace, machine: Machine) -> dict[str, str]:
    """The scheduler options in effect: the command line over the machine's defaults, checked."""
    unknown = sorted(set(machine.defaults) - set(DEFAULT_KEYS))
    if unknown:
        raise SubmitError(
            f"machine file {machine.path}: defaults.{unknown[0]} is not a submit.py option; accepted: "
            + ", ".join(DEFAULT_KEYS)
        )
    options: dict[str, str] = {}
    for key, (schedulers, _) in SCHEDULER_OPTIONS.items():
        given = getattr(args, key)
        value = given if given is not None else machine.defaults.get(key)
        where = f"--{key}" if given is not None else f"machine file {machine.path}: defaults.{key}"
        if isinstance(value, dict):  # {name: most nodes}, in order: the first that takes the job (PBS queues)
            value = by_nodes(value, args.nodes, where)
        if value is None or value == "":
            continue
        if isinstance(value, bool):  # YAML's true/false/yes/no: not a partition or queue name
            raise SubmitError(f"{where} = {value!r}: a name is expected; quote it in YAML if it is one")
        value = str(value)
        if machine.scheduler not in schedulers:
            hint = "--partition, --qos, --constraint" if machine.scheduler == "slurm" else "--queue, --filesystems"
            raise SubmitError(f"{where}: not a {machine.scheduler} option (machine {machine.name}); use {hint}")
        if not DIRECTIVE_VALUE.match(value):
            raise SubmitError(f"{where} = {value!r}: no spaces, quotes, '$', ';' or backslashes")
        options[key] = value
    return options


def by_nodes(choices: dict, nodes: int, where: str) -> str:
    """The first of `choices` ({value: most nodes}, in the machine file's order) that takes `nodes`
    nodes: a site whose queues go by job size (Polaris: debug up to 2 nodes, debug-scaling up to 10,
    prod above). A fixed prod queue was asked for by 2-node jobs, which the site refuses."""
    for value, most in choices.items():
        if type(most) is not int or most < 1:
            raise SubmitError(f"{where}: {value} = {most!r}: the most nodes it takes, an integer >= 1")
        if nodes <= most:
            return str(value)
    raise SubmitError(
        f"{where}: no queue takes {nodes} nodes ({', '.join(f'{v} up to {m}' for v, m in choices.items())}); "
        f"pass one with --{where.rsplit('.', 1)[-1]}"
    )


def default_job_name(deck_path: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", deck_path.stem)
    return name if JOB_NAME.match(name) else f"gridlm-{name}"


def build_script(args: argparse.Namespace, cwd: Path) -> tuple[str, Path, str, Machine]:
    """Check everything and render the job script: (text, output path, launch line, machine)."""
    deck_path = Path(os.path.abspath(cwd / args.deck))
    deck = load_deck(deck_path, tuple(args.overrides))
    name = args.machine or deck.run.machine
    if not name:
        raise SubmitError(
            "no machine: pass --machine NAME or set run.machine in the deck; known machines: "
            + ", ".join(machine_names())
        )
    machine = load_machine(name)
    if args.nodes < 1:
        raise SubmitError(f"--nodes {args.nodes}: must be >= 1")
    world = args.nodes * machine.devices_per_node
    deck = resolve_for_world(deck, world)
    plan = make_plan(deck, world, machine)
    problems = plan.problems
    if problems and not args.force:
        raise SubmitError(
            f"the plan for {world} ranks on {machine.name} has problems: "
            + "; ".join(problems)
            + " (--force writes it anyway)"
        )
    for problem in problems:
        print(f"submit: warning: {problem}", file=sys.stderr)

    time_text = args.time or machine.defaults.get("time")
    if not time_text:
        raise SubmitError(f"no --time and machine file {machine.path} has no defaults.time; e.g. --time 02:00:00")
    where = "--time" if args.time else f"machine file {machine.path}: defaults.time"
    if not isinstance(time_text, str):
        raise SubmitError(
            f"{where} = {time_text!r}: YAML read an unquoted time as a number (of seconds); quote it, e.g. "
            'time: "02:00:00"'
        )
    lead = signal_lead(plan)
    seconds = parse_time(time_text, machine.scheduler, lead, where)
    if lead > SIGNAL_LEAD_S:
        print(
            f"submit: note: SIGUSR1 comes {lead} s before the time limit: the step it falls in (predicted "
            f"{plan.predicted.step_time_s:.0f} s) and a checkpoint must end before it"
            if plan.predicted is not None
            else f"submit: note: SIGUSR1 comes {lead} s before the time limit",
            file=sys.stderr,
        )
    job_name = args.job_name or default_job_name(deck_path)
    if not JOB_NAME.match(job_name):
        raise SubmitError(f"--job-name {job_name!r}: a letter, then letters, digits or _ . + -")
    options = scheduler_options(args, machine)
    directives = "\n".join(SCHEDULER_OPTIONS[k][1][machine.scheduler].format(v) for k, v in options.items())

    run_dir = Path(os.path.abspath(cwd / str(deck.run.dir)))
    if re.search(r"\s", str(run_dir)):
        raise SubmitError(f"run.dir {str(run_dir)!r}: the job log goes there and #SBATCH/#PBS paths cannot hold spaces")
    # Slurm expands %j in --output (a literal % is %%); PBS names the file itself in a directory ending in /.
    output = f"{str(run_dir).replace('%', '%%')}/job-%j.out" if machine.scheduler == "slurm" else f"{run_dir}/"

    # run.machine last so that the app plans for the machine the job runs on.
    # A machine given as a path stays a path (absolute), so that the app finds the same file.
    machine_ref = str(machine_path(name).resolve()) if machine_path(name).parent != MACHINES_DIR else machine.name
    overrides = [*args.overrides, f"run.machine={machine_ref}"]
    launch = machine.launch_line(args.nodes)
    template_path = JOBS_DIR / machine.template
    try:
        template = template_path.read_text()
    except OSError as err:
        raise SubmitError(f"machine file {machine.path}: template = {machine.template!r}: {err}") from None
    checkpoint_gb = checkpoint_bytes(deck) / 1e9
    values: dict[str, Optional[str]] = {
        "job_name": job_name,
        "machine": machine.name,
        "nodes": str(args.nodes),
        "ranks": str(world),
        "ranks_per_node": str(machine.devices_per_node),
        "threads": str(max(1, machine.cpu_cores_per_node // machine.devices_per_node)),
        "time": str(time_text),
        "time_seconds": str(seconds),
        "signal_lead_s": str(lead),
        "output": output,
        "directives": directives,
        "repo": shlex.quote(str(REPO)),
        "workdir": shlex.quote(str(cwd)),
        "deck": shlex.quote(str(deck_path)),
        # Where the run's checkpoints go (checkpoint.dir, else run.dir/checkpoints): templates stripe it.
        "checkpoint_dir": shlex.quote(os.path.abspath(cwd / deck.checkpoint_directory)),
        "checkpoint_gb": f"{checkpoint_gb:,.1f}",
        "setstripe": machine.setstripe(checkpoint_gb),  # the site's Lustre layout for a file this large
        "overrides": " ".join(f"--set {shlex.quote(o)}" for o in overrides),
        "launch": launch,
    }
    text = render(template, values, str(template_path))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)  # the scheduler opens the job log there before the script runs
    except OSError as err:
        raise SubmitError(
            f"run.dir {run_dir}: {path_problem(run_dir, True, err)}; the job log goes there: set run.dir to a "
            "directory that can be created and written (--set run.dir=PATH)"
        ) from None
    out = Path(args.out) if args.out else Path("jobs") / f"{deck_path.stem}-{machine.name}-{args.nodes}n.sh"
    line = f"{launch} python -m app {values['deck']} {values['overrides']}"
    if deck.run.resume == "none":
        print("submit: note: run.resume is none, so a resubmitted job starts over (auto continues)", file=sys.stderr)
    return text, cwd / out, line, machine


def path_problem(path: Path, is_dir: bool, err: OSError) -> str:
    """Why `path` (a file to write, or with `is_dir` a directory to create) could not be written, in
    words that point at the part to change: the OSError alone named a parent, or only its errno."""
    directory = path if is_dir else path.parent
    found = directory
    while not os.path.lexists(found) and found != found.parent:
        found = found.parent
    reason = err.strerror or str(err)
    if found != directory:  # a part of the directory is missing and could not be made
        if not found.is_dir():
            return f"{found} is a file, not a directory"
        which = f"{directory}" if is_dir else f"its directory {directory}"
        return f"{which} does not exist and cannot be created in {found} ({reason})"
    if not directory.is_dir():
        return f"{directory} is a file, not a directory"
    if not is_dir and path.is_dir():
        return "a directory, not a file"
    if err.errno == errno.EROFS:
        return f"{directory} is on a read-only file system"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"{directory} is not writable (permission denied)"
    return f"cannot write there ({reason})"


def out_error(given: str, path: Path, err: OSError) -> SubmitError:
    """The --out of a script that could not be written, as one line with the fix."""
    return SubmitError(
        f"--out {given}: {path_problem(path, False, err)}; pass a path in an existing, writable directory, "
        "e.g. --out jobs/NAME.sh"
    )


def check_given(args: argparse.Namespace) -> None:
    """An option given empty is refused, not read as absent: --out '' or --time '' fell back to the
    default silently. A --out ending in '/' names a directory (Path drops the '/': a file of that name)."""
    for option in ("out", "time", "machine", "job_name"):
        value = getattr(args, option)
        if value is not None and not value.strip():
            flag = "--" + option.replace("_", "-")
            raise SubmitError(f"{flag} {value!r}: empty; pass a value, or omit {flag} for the default")
    if args.out is not None and (args.out.endswith(("/", os.sep)) or os.path.isdir(args.out)):
        raise SubmitError(
            f"--out {args.out}: a directory, not a file; pass the script's path, e.g. --out "
            f"{os.path.join(args.out, 'job.sh')}"
        )


def write_script(path: Path, text: str) -> None:
    """Write a job script (creating its directory), executable like one written by hand."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def submit(path: Path, machine: Machine) -> str:
    """Run sbatch/qsub on the script; the job id."""
    command = SUBMIT_COMMAND[machine.scheduler]
    if shutil.which(command[0]) is None:
        raise SubmitError(
            f"{command[0]} not found on PATH: submit on a login node of {machine.name}, where "
            f"'{command[0]} {path}' works (the script is written)"
        )
    result = subprocess.run([*command, str(path)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SubmitError(f"{command[0]} {path} failed with status {result.returncode}: {result.stderr.strip()}")
    return result.stdout.strip().split(";")[0]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python launch/submit.py",
        description="Write a Slurm/PBS job script that runs DECK on NODES nodes of MACHINE (one rank per "
        "device), after checking the deck against that world size; optionally submit it.",
        epilog="Example: python launch/submit.py inputs/gpt_tiny.yaml --machine perlmutter --nodes 2 "
        "--account m1234_g --set train.global_batch=32 --submit",
    )
    p.add_argument("deck", help="YAML input deck; its absolute path goes into the script")
    p.add_argument(
        "--machine",
        help="machine name (inputs/machines/NAME.yaml: " + ", ".join(machine_names()) + ") or the path "
        "of a machine YAML; default: the deck's run.machine",
    )
    p.add_argument("--nodes", type=int, required=True, help="nodes to allocate; ranks = nodes x devices per node")
    p.add_argument(
        "--time",
        help="time limit, HH:MM:SS (Slurm also D-HH:MM:SS); default: the machine's defaults.time. "
        f"SIGUSR1 comes {SIGNAL_LEAD_S} s before it (more where the dry run predicts a longer step and "
        "checkpoint): the ranks checkpoint and exit 0",
    )
    p.add_argument("--account", help="account/project to charge (#SBATCH --account, #PBS -A)")
    p.add_argument("--partition", help="Slurm partition (default: the machine's)")
    p.add_argument("--qos", help="Slurm quality of service (default: the machine's)")
    p.add_argument("--constraint", help="Slurm node constraint, e.g. gpu or 'gpu&hbm80g' (default: the machine's)")
    p.add_argument("--queue", help="PBS queue (default: the machine's)")
    p.add_argument("--filesystems", help="PBS -l filesystems=..., e.g. home:eagle (default: the machine's)")
    p.add_argument("--job-name", help="scheduler job name (default: the deck's file stem)")
    p.add_argument(
        "--out",
        help="where to write the script (default: jobs/<deck stem>-<machine>-<N>n.sh under the current directory)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a deck key (repeatable); checked now and passed to the app in the script",
    )
    p.add_argument("--submit", action="store_true", help="run sbatch (Slurm) or qsub (PBS) on the script")
    p.add_argument("--force", action="store_true", help="write the script even if the plan check reports problems")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        check_given(args)
        text, path, line, machine = build_script(args, Path.cwd())
        try:
            write_script(path, text)
        except OSError as err:
            raise out_error(args.out or str(path), path, err) from None
        print(f"submit: wrote {path}")
        print(f"submit: launch: {line}")
        if args.submit:
            job = submit(path, machine)
            print(f"submit: job {job} submitted")
        else:
            print(f"submit: submit with: {SUBMIT_COMMAND[machine.scheduler][0]} {path}")
    except (GridlmError, OSError) as err:
        print(f"submit: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
