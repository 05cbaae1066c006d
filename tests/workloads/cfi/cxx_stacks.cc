// C++ as distributions build it (-O2, no frame pointers, PIE) over
// libstdc++, which has none either: allocations through operator new from
// std::map, std::string and std::vector, in two functions, and a leak.
//
//   cxx_stacks ROUNDS
//
// Prints "ready", waits for a byte on stdin, runs, prints the number of
// blocks it leaked ("leaked_objects N") and of buffers its vectors
// allocated ("vector_allocs N"), then "done", and waits
// for another byte (or the end of stdin).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

static std::map<int, std::string> *leaked;

__attribute__((noinline, noclone)) static void fill_map(int n)
{
    std::map<int, std::string> m;
    for (int i = 0; i < n; i++)
        m[i] = std::string(40 + i % 8, 'x');
    leaked = new std::map<int, std::string>(m);
}

static size_t vector_allocs; // the buffers grow_vector's vectors allocated

__attribute__((noinline, noclone)) static size_t grow_vector(int n)
{
    std::vector<long> v;
    for (int i = 0; i < n; i++) {
        size_t capacity = v.capacity();
        v.push_back(i);
        vector_allocs += v.capacity() != capacity; // a new buffer
    }
    return v.size();
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? std::atoi(argv[1]) : 20;
    char byte;
    std::printf("ready\n");
    std::fflush(stdout);
    if (read(0, &byte, 1) != 1)
        return 1;
    fill_map(1000);
    size_t total = 0;
    for (int i = 0; i < rounds; i++)
        total += grow_vector(1000);
    // leaked: the map, and each of its nodes with its string's buffer (40
    // to 47 characters: longer than a string holds without one)
    std::printf("total %zu leaked %zu\nleaked_objects %zu\nvector_allocs %zu\ndone\n", total,
                leaked->size(), 1 + 2 * leaked->size(), vector_allocs);
    std::fflush(stdout);
    if (read(0, &byte, 1) < 0)
        return 1;
    return 0;
}
