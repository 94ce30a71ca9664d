#!/usr/bin/env python3
"""Checks ops/dashboard.json: every panel's query parses as PromQL (promtool, through a
recording rule each), and every metric it reads is one the metrics table lists (the crate's rustdoc,
src/docs/operating.md).
Exits non-zero on the first failure.

    python3 scripts/check-dashboard.py
"""
import json
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main():
    dashboard = json.loads((ROOT / "ops/dashboard.json").read_text())
    docs = (ROOT / "src/docs/operating.md").read_text()
    listed = set(re.findall(r"`(idempotency_[a-z_]+)`", docs))
    rules, failures = [], []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            # Grafana's variables are not PromQL: the rate window is any duration.
            expr = target["expr"].replace("$__rate_interval", "5m")
            rules.append({"record": f"panel_{panel['id']}_{target['refId']}", "expr": expr})
            for metric in set(re.findall(r"\b(idempotency_[a-z_]+)", expr)):
                if metric not in listed:
                    failures.append(f"panel {panel['title']!r}: {metric} is not in the metrics table (src/docs/operating.md)")
    if not rules:
        failures.append("the dashboard has no queries")
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as file:
        json.dump({"groups": [{"name": "dashboard", "rules": rules}]}, file)
    checked = subprocess.run(["promtool", "check", "rules", file.name], capture_output=True, text=True)
    if checked.returncode != 0:
        failures.append("promtool refused a query:\n" + checked.stdout + checked.stderr)
    if failures:
        sys.exit("\n".join(failures))
    print(f"dashboard: {len(rules)} queries parse, every metric they read is documented")


if __name__ == "__main__":
    main()
