package main

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/tsock/tsock/ring"
)

// version is tsock's release; override with
// -ldflags "-X main.version=...".
var version = "0.1.0-dev"

// C ABI version of include/tsock.h (TSOCK_VERSION_MAJOR/MINOR).
const abiMajor, abiMinor = 0, 1

func init() {
	register(&command{
		name:    "version",
		summary: "print the version of tsock, its C ABI and its segment layout",
		run:     runVersion,
	})
}

// runVersion prints one line: release, ABI, layout version, VCS revision
// when the binary was built from a checkout, and the Go toolchain.
func runVersion(e *env, args []string) int {
	if len(args) != 0 {
		fmt.Fprintf(e.stderr, "usage: tsock version\n")
		return exitUsage
	}
	rev := ""
	if bi, ok := debug.ReadBuildInfo(); ok {
		var dirty bool
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
				if len(rev) > 12 {
					rev = rev[:12]
				}
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if rev != "" && dirty {
			rev += "+dirty"
		}
	}
	fmt.Fprintf(e.stdout, "tsock %s (C ABI %d.%d, layout v%d", version, abiMajor, abiMinor, ring.LayoutVersion)
	if rev != "" {
		fmt.Fprintf(e.stdout, ", commit %s", rev)
	}
	fmt.Fprintf(e.stdout, ", %s %s/%s)\n", runtime.Version(), runtime.GOOS, runtime.GOARCH)
	return exitOK
}
