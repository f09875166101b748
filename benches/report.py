"""bench.py report: a report's tables (any bench.py JSON) printed again as markdown, as its subcommand printed them."""
import json

from benches import batch, common, formats, lengths, parts, peers, profile, quality, racer, requests, speed

HELP = "print a report's tables (any bench.py JSON) as markdown"
# a report's sections in the order the subcommands print them, each with its table
SECTIONS = {"weight_costs": formats.weight_cost_table, "formats": formats.format_table, "speed": None,
            "phases": speed.phase_table, "parts": parts.parts_table, "profile": profile.tables,
            "lengths": lengths.length_table, "short_requests": requests.short_table, "racer": racer.racer_table,
            "peer": peers.peer_table, "batch": batch.batch_table, "overlap_phases": batch.overlap_table,
            "quality": quality.quality_table}


def options(p):
    p.add_argument("file")


def report_tables(report):
    """Every table of a report (old reports, from before the subcommands, included), in the order the
    subcommands print them; several reports bundled under a note ({"note", "runs"}) one after the other."""
    if "runs" in report:
        return "\n\n".join([report.get("note", "")] + [report_tables(run) for run in report["runs"]])
    tables = []
    if "machine" in report:
        tables.append(common.machine_line(report["machine"]))
    for key, table in SECTIONS.items():
        if not report.get(key):
            continue
        if key == "speed":  # its roofline columns need the run's copy bandwidth
            tables.append(common.caption(report) + speed.speed_table(report["speed"], report["copy_bandwidth_gbs"]))
        else:
            tables.append(common.caption(report) + table(report[key]))
    return "\n\n".join(tables)


def run(args):
    with open(args.file) as f:
        print(report_tables(json.load(f)))
