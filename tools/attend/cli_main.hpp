// cli_main.hpp: the attend command line as a function, for the executable, tests and fuzzers.
#pragma once

// Runs `attend` with these arguments (argv[0] is the program name and is ignored). Writes to
// stdout and stderr, never throws, never exits. Returns 0 on success (including --help and
// --version) and 2 after printing one line "error: ..." to stderr.
int attend_cli_main(int argc, char** argv);
