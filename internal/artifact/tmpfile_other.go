//go:build !linux

package artifact

import (
	"errors"
	"os"
)

var errNoUnnamed = errors.New("unnamed temporary files are not supported here")

// openUnnamed is not supported where O_TMPFILE does not exist: Puts use
// named temporary files (unnamedSupported is false).
func openUnnamed(string) (*os.File, error) { return nil, errNoUnnamed }

func linkUnnamed(*os.File, string) error { return errNoUnnamed }

func unnamedSupported(string) bool { return false }
