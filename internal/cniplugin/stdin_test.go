package cniplugin

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"testing/iotest"
)

func TestReadCapped(t *testing.T) {
	const limit = 3*firstRead + 7
	for _, n := range []int{0, 1, firstRead - 1, firstRead, firstRead + 1, limit, limit + 1, 2 * limit} {
		in := bytes.Repeat([]byte{'x'}, n)
		for name, r := range map[string]io.Reader{
			"whole":    bytes.NewReader(in),
			"one byte": iotest.OneByteReader(bytes.NewReader(in)),
		} {
			got, err := readCapped(r, limit)
			if err != nil {
				t.Fatalf("%d bytes, %s reads: %v", n, name, err)
			}
			if want := min(n, limit+1); len(got) != want || !bytes.Equal(got, in[:want]) {
				t.Errorf("%d bytes, %s reads: got %d bytes, want the first %d", n, name, len(got), want)
			}
		}
	}
	boom := errors.New("boom")
	for _, n := range []int{10, firstRead + 10} {
		r := io.MultiReader(bytes.NewReader(make([]byte, n)), iotest.ErrReader(boom))
		if _, err := readCapped(r, limit); !errors.Is(err, boom) {
			t.Errorf("read error after %d bytes: %v, want it passed on", n, err)
		}
	}
}
