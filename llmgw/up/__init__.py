"""`llmgw up`: the whole system on one machine, as one command.

It runs a private Postgres in a data dir, then `llmgw controlplane` and one or two
`llmgw agent` processes (simulated GPUs, and this machine's real ones) as its children,
applies a demo model, and prints the OpenAI URL, an API key and the admin token once the
endpoint answers. A second run on the same data dir resumes with the same data and key.

    options.py      UpOptions: what one run is asked for, and its listeners' URLs
    launcher.py     the start sequence (lock, ports, Postgres, migrations, children) and the stop
    children.py     one supervised child process, the data dir's lock, leftovers of a killed run
    supervision.py  restarting a child or Postgres that died
    bringup.py      readiness, key, demo, replica progress, the endpoint's answer, the announcement
    bootstrap.py    what those steps do through the APIs: tokens, key, demo, progress, the text

The CLI command is llmgw/commands/up.py; it turns flags and settings into UpOptions.
"""
