// main.cpp: the attend executable. Everything happens in attend_cli_main (cli_main.cpp).
#include "cli_main.hpp"

int main(int argc, char** argv) { return attend_cli_main(argc, argv); }
