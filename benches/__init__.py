"""bench.py's subcommands, a module each (speed, parts, lengths, requests, racer, batch, peers, quality, formats,
report): each names its help (HELP), its --quick settings (QUICK), its options and what it runs (run); common.py
holds what they share, scoring.py the completions and scores that quality, requests and formats share."""
