package dev.idempotency.client.readme;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;

/** The fenced code blocks of a Markdown file, for the tests that keep the documentation true. */
public final class Snippets {
  private Snippets() {}

  /**
   * The blocks fenced as {@code language} (```java), in order, each as its lines.
   *
   * @param markdown the file
   * @param language the fence's info string
   * @return the blocks
   * @throws IOException when the file cannot be read
   */
  public static List<List<String>> of(Path markdown, String language) throws IOException {
    List<List<String>> blocks = new ArrayList<>();
    List<String> open = null;
    for (String line : Files.readAllLines(markdown, StandardCharsets.UTF_8)) {
      if (open == null) {
        if (line.equals("```" + language)) {
          open = new ArrayList<>();
        }
      } else if (line.equals("```")) {
        blocks.add(List.copyOf(open));
        open = null;
      } else {
        open.add(line);
      }
    }
    if (open != null) {
      throw new IllegalStateException(markdown + ": a ```" + language + " block is not closed");
    }
    return blocks;
  }

  /**
   * Where {@code block} appears in {@code source}, line for line, every line indented alike (a
   * snippet in a method body); -1 when it does not.
   *
   * @param source the lines of a source file
   * @param block the snippet
   * @return the index of its first line in source, or -1
   */
  public static int indexIn(List<String> source, List<String> block) {
    if (block.isEmpty()) {
      return -1;
    }
    String first = block.get(0);
    for (int i = 0; i + block.size() <= source.size(); i++) {
      String line = source.get(i);
      if (!line.endsWith(first)) {
        continue;
      }
      String indent = line.substring(0, line.length() - first.length());
      if (!indent.isBlank()) {
        continue;
      }
      boolean same = true;
      for (int j = 1; j < block.size() && same; j++) {
        String want = block.get(j);
        same = want.isEmpty() ? source.get(i + j).isBlank() : source.get(i + j).equals(indent + want);
      }
      if (same) {
        return i;
      }
    }
    return -1;
  }
}
