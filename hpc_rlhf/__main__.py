from hpc_rlhf.cli import console_main

console_main()
