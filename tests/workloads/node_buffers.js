// Buffers allocated from named JavaScript functions, for comparing a
// tracer's JIT frames (named from V8's perf map) and counts with what the
// program did.
//
//     node --perf-basic-prof --always-sparkplug --no-turbo-inlining node_buffers.js
//
// --perf-basic-prof has V8 write /tmp/perf-PID.map, a line per code object
// it compiles (START SIZE NAME, in hex). --always-sparkplug compiles every
// function to machine code (Sparkplug's, in anonymous executable memory) at
// its first call, so every call of the chain runs as JIT code, never in the
// interpreter's trampoline; --no-turbo-inlining keeps each function its own
// frame when TurboFan optimizes a hot one. Without --perf-basic-prof the
// same code runs, unnamed.
//
// Protocol. The program prints "ready" and waits for a line on standard
// input (a tracer attaches meanwhile). On "go" it runs the chain, prints one
// line of JSON, the ledger, and waits again: on "exit" or at the end of its
// input it exits with status 0. Any other line than "go" first, or the end
// of the input there, ends it with status 1.
//
// The chain: outer calls middle CALLS times, and middle calls leaf, which
// makes one Buffer.allocUnsafeSlow(SIZE). Node 20 takes that to
// NodeArrayBufferAllocator::AllocateUninitialized, which calls the libc's
// malloc(SIZE), once per buffer (Buffer.alloc(SIZE) would call calloc(SIZE,
// 1) instead, and Buffer.allocUnsafe of small sizes takes a slice of a
// shared pool). SIZE is a size nothing else in Node asks for. Every buffer
// stays referenced until the process exits.
//
// The ledger: {"pid", "fn": "malloc", "size", "calls", "bytes",
// "functions": ["leaf", "middle", "outer"] (innermost first), "perf_map":
// whether V8 writes its perf map (--perf-basic-prof given)}.

'use strict';

const readline = require('readline');

const SIZE = 98317;
const CALLS = 300;
const kept = [];

function leaf() {
  kept.push(Buffer.allocUnsafeSlow(SIZE));
}

function middle() {
  leaf();
}

function outer() {
  for (let i = 0; i < CALLS; i++) {
    middle();
  }
}

function ledger() {
  return {
    pid: process.pid,
    fn: 'malloc',
    size: SIZE,
    calls: kept.length,
    bytes: kept.reduce((sum, buffer) => sum + buffer.length, 0),
    functions: ['leaf', 'middle', 'outer'],
    perf_map: process.execArgv.includes('--perf-basic-prof'),
  };
}

const lines = readline.createInterface({ input: process.stdin });
let ran = false;
lines.on('line', (line) => {
  if (!ran && line.trim() === 'go') {
    ran = true;
    outer();
    process.stdout.write(JSON.stringify(ledger()) + '\n');
  } else if (!ran) {
    process.exit(1);
  } else if (line.trim() === 'exit') {
    process.exit(0);
  }
});
lines.on('close', () => process.exit(ran ? 0 : 1));
process.stdout.write('ready\n');
