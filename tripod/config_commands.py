"""The commands a command-line option can belong to (``config_cli.Opt.commands``), shared by the
config modules."""

GENERATE, CHAT, SERVE, ROUTE, CHAINS_SERVE = "generate", "chat", "serve", "route", "chains serve"
ENGINE_COMMANDS = (GENERATE, CHAT, SERVE)
BENCH_DIR_HELP = ("where tripod bench wrote its runs (a --out folder, or a folder of them): the console's "
                  "Benchmarks view and history")
