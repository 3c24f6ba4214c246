package cniplugin

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/containernetworking/cni/pkg/types"
	"golang.org/x/sys/unix"
)

// capStdin bounds what the plugin reads from stdin. skel reads stdin to its end
// with no limit (a 200 MB stdin took over 400 MB of memory), so the plugin reads
// it first, at most limit bytes, and puts exactly that back as fd 0 (a memfd)
// for skel to read again. Stdin larger than limit is an invalid network
// configuration. VERSION and a call without CNI_COMMAND do not read stdin.
func capStdin(command string, limit int) *types.Error {
	if command == "" || command == "VERSION" {
		return nil
	}
	// One buffer of the limit and a byte: io.ReadAll would grow its buffer by
	// doubling and leave the garbage of every step to the collector.
	buf := make([]byte, limit+1)
	n, err := io.ReadFull(os.Stdin, buf)
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
		return types.NewError(types.ErrIOFailure, "mesh-cni: cannot read the network configuration from stdin", err.Error())
	}
	data := buf[:n]
	if len(data) > limit {
		return types.NewError(types.ErrInvalidNetworkConfig,
			fmt.Sprintf("mesh-cni: the network configuration on stdin is larger than the limit of %d bytes", limit), "")
	}
	if err := replaceStdin(data); err != nil {
		return types.NewError(types.ErrIOFailure, "mesh-cni: cannot hand the network configuration on", err.Error())
	}
	return nil
}

// replaceStdin makes fd 0 a memfd holding data, positioned at its start.
func replaceStdin(data []byte) error {
	fd, err := unix.MemfdCreate("mesh-cni-stdin", unix.MFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "mesh-cni-stdin")
	defer f.Close()
	if _, err := f.Write(data); err != nil {
		return fmt.Errorf("write memfd: %w", err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("seek memfd: %w", err)
	}
	// dup3 without O_CLOEXEC: fd 0 stays what it is, only its file changes.
	if err := unix.Dup3(int(f.Fd()), 0, 0); err != nil {
		return fmt.Errorf("dup3 onto stdin: %w", err)
	}
	return nil
}
