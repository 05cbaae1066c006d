"""The subcommands of ``mtrace-live``, one module each.

Each module holds one click command and imports the machinery it drives
only when it runs, so ``--help`` needs neither root nor bcc. Shared options
and the rules on combining them are in ``options``; tracer/cli.py lists the
commands.
"""
