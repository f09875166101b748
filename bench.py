"""The engine's benchmarks, one subcommand each (speed, parts, profile, lengths, requests, racer, batch, peers,
quality, formats): each prints markdown tables and writes them with the settings and the machine to --out (JSON);
`report` prints a report's tables again. Methods run interleaved in one process: ratios within a run are what count."""
import argparse
import datetime
import os
import sys

import torch

import model
from benches import batch, common, formats, lengths, parts, peers, profile, quality, racer, report, requests, speed
from weights import make_gguf

COMMANDS = {"speed": speed, "parts": parts, "profile": profile, "lengths": lengths, "requests": requests,  # benches/
            "racer": racer, "batch": batch, "peers": peers, "quality": quality, "formats": formats}
FILES_ONLY = ("peers", "quality", "formats")  # subcommands that need model files, not --random
EPILOG = """examples:
  python bench.py speed                                # the default pair: ar, sd and smc on code and prose prompts
  python bench.py speed --random llama-1b:llama-8b --grid 8x8,4x4 --methods ar,smc --prompt-len 256
  python bench.py profile --random llama-1b:llama-8b --prompt-len 256   # one cycle of ar and smc taken apart
  python bench.py speed --random qwen3-0.6b:qwen3-8b --methods ar,smc   # the Qwen3 pair's shapes
  python bench.py lengths --prompt-lengths 100,4000
  python bench.py batch --methods ar,sd,smc,sd+overlap,smc+overlap --concurrency 2,4
  python bench.py quality --methods ar,sd,easd,mdsd,smc,draft --problems 40 --samples 1
  python bench.py report bench-speed.json              # its tables again, as markdown
  python bench.py make-gguf qwen2.5-7b --dir /data     # a 7B's shape, random weights: for speed and peers' --target"""


def parser(argv):
    """Each subcommand's parser from its module (its help, options and --quick settings, which flags given win
    over), the options they share from common's."""
    shared = common.options()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, bench in COMMANDS.items():
        sub = commands.add_parser(name, parents=[shared], help=bench.HELP, description=bench.HELP)
        bench.options(sub)
        if "--quick" in argv:
            sub.set_defaults(**bench.QUICK)
    report.options(commands.add_parser("report", help=report.HELP))
    make_gguf.options(commands.add_parser("make-gguf", help=make_gguf.HELP, description=make_gguf.HELP))
    return p


def parse(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    p = parser(argv)
    args = p.parse_args(argv)
    if args.command in ("report", "make-gguf"):
        return args
    if args.out is None:
        args.out = f"bench-{args.command}.json"
    if args.random and args.command in FILES_ONLY:
        p.error(f"{args.command} needs model files (a weights/ pair or --target), not --random")
    if args.weights == "auto" and args.random:
        p.error("--weights auto measures model files (a weights/ pair or --target); name a format with --random")
    return args


def main(argv=None):
    args = parse(argv)
    if args.command == "report":
        report.run(args)
        return None
    if args.command == "make-gguf":
        make_gguf.run(args)
        return None
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rank, world = model.init_distributed(device)  # torchrun: every rank runs the same, rank 0 reports
    if rank:
        sys.stdout = open(os.devnull, "w")
    made = {"command": args.command, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": common.machine(device), "settings": dict(vars(args)), "tensor_parallel": world}
    print(common.machine_line(made["machine"]) + "\n", flush=True)
    if common.random_weights([args.target, args.draft]):
        made["random_weights"] = True
        print(common.caption(made), end="", flush=True)
    COMMANDS[args.command].run(args, device, rank, world, made)
    common.write(made, args.out, rank)
    print(f"wrote {os.path.abspath(args.out)}")
    if world > 1:
        torch.distributed.destroy_process_group()
    return made


if __name__ == "__main__":
    main()
