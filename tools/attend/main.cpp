#include <cstdio>
#include "attend/attend.hpp"
int main() { std::printf("attend %s\n", attend::version()); return 0; }
