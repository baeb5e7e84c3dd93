package main

import "fmt"

func init() {
	register(&command{
		name:    "help",
		args:    "[COMMAND]",
		summary: "show help for tsock or for one command",
		run:     runHelp,
	})
}

// runHelp prints the command list, or the help of the named command.
func runHelp(e *env, args []string) int {
	switch len(args) {
	case 0:
		usage(e.stdout)
		return exitOK
	case 1:
		c, ok := commands[args[0]]
		if !ok {
			fmt.Fprintf(e.stderr, "tsock help: unknown command %q\n", args[0])
			return exitUsage
		}
		printCommandHelp(e.stdout, c)
		return exitOK
	}
	fmt.Fprintf(e.stderr, "usage: tsock help [COMMAND]\n")
	return exitUsage
}
