// Command tsock is the operator's tool for tsock channels: shared-memory
// rings in /dev/shm through which one producer publishes batches of tensors
// to any number of reader processes on the same node.
//
// Usage:
//
//	tsock <command> [flags] [arguments]
//
// Commands:
//
//	demo      run a producer and N reader processes and report their rates
//	version   print the version
//	help      show help for tsock or for one command
//
// Each command lives in its own file and registers itself with register
// from an init function, so new commands (ls, stat, rm, gpus, ...) need no
// change here.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// Exit statuses of tsock.
const (
	exitOK    = 0 // success
	exitFail  = 1 // the command ran and failed
	exitUsage = 2 // bad command line
)

// env is what a command may use besides its arguments: where to print.
// Commands never write to os.Stdout directly, so tests can run them
// in-process and capture their output.
type env struct {
	stdout io.Writer
	stderr io.Writer
}

// command is one subcommand of tsock.
type command struct {
	name    string // what the user types
	args    string // argument synopsis after the flags, e.g. "NAME"
	summary string // one line for the command list
	help    string // longer description for `tsock help <name>`; may be empty
	hidden  bool   // internal (used by tsock itself); not listed by help
	// run executes the command with the arguments after its name and
	// returns the exit status.
	run func(e *env, args []string) int
	// flags, when set, builds the command's flag set (for help output).
	flags func() *flag.FlagSet
}

// commands is the registry filled by register.
var commands = map[string]*command{}

// register adds c to the registry; it is called from init functions.
func register(c *command) {
	if _, dup := commands[c.name]; dup {
		panic("tsock: command registered twice: " + c.name)
	}
	commands[c.name] = c
}

func main() {
	os.Exit(run(os.Args[1:], &env{stdout: os.Stdout, stderr: os.Stderr}))
}

// run dispatches args (without the program name) to a command and returns
// the exit status.
func run(args []string, e *env) int {
	if len(args) == 0 {
		usage(e.stderr)
		return exitUsage
	}
	name := args[0]
	switch name {
	case "-h", "-help", "--help":
		usage(e.stdout)
		return exitOK
	case "-version", "--version":
		name = "version"
	}
	c, ok := commands[name]
	if !ok {
		fmt.Fprintf(e.stderr, "tsock: unknown command %q\n\n", name)
		usage(e.stderr)
		return exitUsage
	}
	return c.run(e, args[1:])
}

// usage prints the list of visible commands.
func usage(w io.Writer) {
	fmt.Fprintf(w, "tsock: shared-memory tensor channels\n\nUsage:\n\n\ttsock <command> [flags] [arguments]\n\nCommands:\n\n")
	for _, c := range visibleCommands() {
		fmt.Fprintf(w, "\t%-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(w, "\nRun 'tsock help <command>' for the flags of a command.\n")
}

// visibleCommands lists the non-hidden commands by name.
func visibleCommands() []*command {
	var out []*command
	for _, c := range commands {
		if !c.hidden {
			out = append(out, c)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

// newFlagSet returns a flag set for command name that reports errors to
// e.stderr instead of exiting.
func newFlagSet(name string, w io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("tsock "+name, flag.ContinueOnError)
	fs.SetOutput(w)
	return fs
}

// parseFlags parses args into fs and maps the outcome to an exit status:
// ok is false when the caller should return status at once (-h gives
// exitOK, a bad flag exitUsage).
func parseFlags(fs *flag.FlagSet, args []string) (status int, ok bool) {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK, false
		}
		return exitUsage, false
	}
	return exitOK, true
}

// printCommandHelp writes the synopsis, description and flags of c.
func printCommandHelp(w io.Writer, c *command) {
	synopsis := "tsock " + c.name
	if c.flags != nil {
		synopsis += " [flags]"
	}
	if c.args != "" {
		synopsis += " " + c.args
	}
	fmt.Fprintf(w, "Usage: %s\n\n%s\n", synopsis, c.summary)
	if c.help != "" {
		fmt.Fprintf(w, "\n%s\n", strings.TrimRight(c.help, "\n"))
	}
	if c.flags != nil {
		fs := c.flags()
		fs.SetOutput(w)
		fmt.Fprintf(w, "\nFlags:\n")
		fs.PrintDefaults()
	}
}
