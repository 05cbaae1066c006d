/* A program that loads the largest library of the machine, libLLVM-15
 * (979,120 CFI rows), with dlopen while traced, and allocates through it at
 * once: built as distributions build theirs (-O2, no frame pointers, PIE).
 *
 *   llvm_user LIBRARY ROUNDS
 *
 * Prints "ready" and waits for a byte on stdin; then loads LIBRARY and,
 * ROUNDS times, builds a module of one function through the library's C
 * API and disposes of it: main > run_rounds > build_module > LLVM... >
 * operator new > malloc. Prints "rounds N" and "done", and exits. Its only
 * allocations after the byte are the dynamic loader's (dlopen) and the
 * library's. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef void *(*context_create_fn)(void);
typedef void (*context_dispose_fn)(void *);
typedef void *(*module_create_fn)(const char *, void *);
typedef void (*module_dispose_fn)(void *);
typedef void *(*int32_type_fn)(void *);
typedef void *(*function_type_fn)(void *, void **, unsigned, int);
typedef void *(*add_function_fn)(void *, const char *, void *);
typedef void *(*append_block_fn)(void *, void *, const char *);
typedef void *(*builder_create_fn)(void *);
typedef void (*builder_position_fn)(void *, void *);
typedef void *(*const_int_fn)(void *, unsigned long long, int);
typedef void *(*build_ret_fn)(void *, void *);
typedef void (*builder_dispose_fn)(void *);

static struct {
    context_create_fn context_create;
    context_dispose_fn context_dispose;
    module_create_fn module_create;
    module_dispose_fn module_dispose;
    int32_type_fn int32_type;
    function_type_fn function_type;
    add_function_fn add_function;
    append_block_fn append_block;
    builder_create_fn builder_create;
    builder_position_fn builder_position;
    const_int_fn const_int;
    build_ret_fn build_ret;
    builder_dispose_fn builder_dispose;
} api;

static int found(void *library, void **slot, const char *name)
{
    *slot = dlsym(library, name);
    if (!*slot)
        fprintf(stderr, "%s: %s\n", name, dlerror());
    return *slot != NULL;
}

__attribute__((noinline)) static void build_module(void *context, int round)
{
    void *module = api.module_create("m", context);
    void *i32 = api.int32_type(context);
    void *type = api.function_type(i32, NULL, 0, 0);
    void *function = api.add_function(module, round & 1 ? "odd" : "even", type);
    void *block = api.append_block(context, function, "entry");
    void *builder = api.builder_create(context);
    api.builder_position(builder, block);
    api.build_ret(builder, api.const_int(i32, (unsigned long long)round, 0));
    api.builder_dispose(builder);
    api.module_dispose(module);
    __asm__ volatile("" ::: "memory"); /* not a tail call */
}

__attribute__((noinline)) static void run_rounds(int rounds)
{
    void *context = api.context_create();
    for (int round = 0; round < rounds; round++)
        build_module(context, round);
    api.context_dispose(context);
    __asm__ volatile("" ::: "memory");
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    int rounds = atoi(argv[2]);
    char byte;
    printf("ready\n");
    fflush(stdout);
    if (read(0, &byte, 1) != 1)
        return 1;
    void *library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!library) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    int ok = found(library, (void **)&api.context_create, "LLVMContextCreate") &
             found(library, (void **)&api.context_dispose, "LLVMContextDispose") &
             found(library, (void **)&api.module_create, "LLVMModuleCreateWithNameInContext") &
             found(library, (void **)&api.module_dispose, "LLVMDisposeModule") &
             found(library, (void **)&api.int32_type, "LLVMInt32TypeInContext") &
             found(library, (void **)&api.function_type, "LLVMFunctionType") &
             found(library, (void **)&api.add_function, "LLVMAddFunction") &
             found(library, (void **)&api.append_block, "LLVMAppendBasicBlockInContext") &
             found(library, (void **)&api.builder_create, "LLVMCreateBuilderInContext") &
             found(library, (void **)&api.builder_position, "LLVMPositionBuilderAtEnd") &
             found(library, (void **)&api.const_int, "LLVMConstInt") &
             found(library, (void **)&api.build_ret, "LLVMBuildRet") &
             found(library, (void **)&api.builder_dispose, "LLVMDisposeBuilder");
    if (!ok)
        return 1;
    run_rounds(rounds);
    printf("rounds %d\ndone\n", rounds);
    fflush(stdout);
    return 0;
}
