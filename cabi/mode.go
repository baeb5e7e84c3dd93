package main

import "os"

func fileMode(m uint32) os.FileMode { return os.FileMode(m) }
